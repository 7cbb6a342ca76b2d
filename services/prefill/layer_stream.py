"""A prompt's KV sent layer by layer while its final chunk's forward runs.

Two threads meet here. The event loop owns every `LayerStream` (its sender, its send task);
the engine's step thread only reads the registry and posts layers:

    event loop                                   step thread (inside engine.step)
    ----------                                   --------------------------------
    destination known, sender opened
    streams.offer(request_id, stream)  --lock--> streams.watch(plan)    [before the launch]
                                                   final prompt chunk of an offered request:
                                                   claim it (stream.block_ids = its table)
                                                   -> LayerProgress for the forward
                                                 layer i queued -> event_i recorded
    stream.layer_done(i, event_i)  <-call_soon_threadsafe--
    sender.send_layers(run, cache, block_ids, ready=event_i)   (runs of layers that arrived
    ... after the last layer: sender.finish()                   together go as one run)
    streams.take(request_id) after the step:
        claimed     -> await stream.result()     (the transfer's stats, or its error)
        not claimed -> the caller sends after the step with stream.sender (as before)

A stream is claimed only when its destination was known when the final chunk's step
started; one that arrives later is sent after the step. `block_ids` is the sequence's
table at that step: the prompt's blocks, the ones the export holds afterwards. On CUDA the
send of layer i is ordered after event i on the transfer's stream (CUDA IPC: one copy launch,
returns at once); on CPU a layer's KV is written when its forward returns. Nothing here waits
for the device or blocks the step thread.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Literal, get_args

import torch

from cleave.engine.layer_progress import LayerProgress
from cleave.engine.scheduler import SchedulerOutput
from cleave.kv.manager import transfer_pages
from cleave.rpc.types import TransferStats
from cleave.transfer import KVSender

# "auto": CUDA IPC handles only (a copy launch per run that returns at once); "on": any
# transport (TCP gathers and writes each layer on the event loop); "off": after the step.
LayerStreaming = Literal["auto", "on", "off"]
LAYER_STREAMING_MODES: tuple[str, ...] = get_args(LayerStreaming)


class LayerStream:
    """One request's layer-by-layer send (event loop only, but `block_ids`, set by the claim).

    Args:
        sender: an open sender to the request's destination.
        cache: the prefill engine's KV cache [L, 2, NB, BS, Hkv, D].
    """

    def __init__(self, sender: KVSender, cache: torch.Tensor) -> None:
        self.sender = sender
        self.cache = cache
        self.block_ids: list[int] | None = None  # set by the step thread when it claims the stream
        self._ready: list[tuple[int, torch.cuda.Event | None]] = []
        self._arrived = asyncio.Event()
        self._task: asyncio.Task[TransferStats] | None = None
        self._closed = False

    @property
    def is_claimed(self) -> bool:
        return self.block_ids is not None

    def layer_done(self, layer: int, ready: torch.cuda.Event | None) -> None:
        """Layer `layer`'s KV is queued (event loop; the step thread posts it)."""
        if self._closed:
            return
        self._ready.append((layer, ready))
        self._arrived.set()
        if self._task is None:
            self._task = asyncio.ensure_future(self._send())

    async def _send(self) -> TransferStats:
        assert self.block_ids is not None
        num_layers = self.cache.shape[0]
        sent = 0
        while sent < num_layers:
            await self._arrived.wait()
            self._arrived.clear()
            ready, self._ready = self._ready, []
            # layers that arrived together go as one run, after the latest one's event
            layers = range(ready[0][0], ready[-1][0] + 1)
            event = ready[-1][1]
            await self.sender.send_layers(layers, self.cache, self.block_ids, ready=event or "complete")
            sent = layers.stop
        return await self.sender.finish()

    async def result(self) -> TransferStats:
        """The transfer's stats once the receiver confirmed every layer (after the step that
        claimed the stream ended); raises the send's or the receiver's error."""
        if self._task is None:  # the step ran no layer of it (it failed first)
            raise RuntimeError("the stream was claimed but no layer was reported")
        return await self._task

    async def close(self) -> None:
        """Stop sending and wait until no queued copy reads the source blocks any more."""
        self._closed = True
        if self._task is not None and not self._task.done():
            self._task.cancel()
        if self._task is not None:
            await asyncio.gather(self._task, return_exceptions=True)
        await self.sender.close()


class LayerStreams:
    """Request id -> the `LayerStream` offered for it: the registry both threads share.

    Args:
        loop: the event loop the streams live on.
        num_layers: the model's decoder layers.
        device: the KV cache's device.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, num_layers: int, device: torch.device) -> None:
        self._loop = loop
        self._num_layers = num_layers
        self._device = device
        self._lock = threading.Lock()
        self._offered: dict[str, LayerStream] = {}
        self.num_claimed = 0  # streams the step thread claimed so far

    def offer(self, request_id: str, stream: LayerStream) -> None:
        """Event loop: let the step that runs `request_id`'s final chunk stream its layers."""
        with self._lock:
            self._offered[request_id] = stream

    def __contains__(self, request_id: str) -> bool:
        """Whether a stream is offered for `request_id` (any thread)."""
        with self._lock:
            return request_id in self._offered

    def take(self, request_id: str) -> LayerStream | None:
        """Event loop: withdraw the request's stream (claimed or not), None when none was offered."""
        with self._lock:
            return self._offered.pop(request_id, None)

    def watch(self, output: SchedulerOutput) -> LayerProgress | None:
        """Step thread, before the launch (`LLMEngine.watch_layers`): claim the offered
        streams of prompts whose final chunk runs in this step."""
        if not self._offered:
            return None
        claimed: list[LayerStream] = []
        with self._lock:
            for entry in output.scheduled:
                if not (entry.sample and entry.is_prefill):
                    continue
                stream = self._offered.get(entry.seq.request_id)
                if stream is not None and not stream.is_claimed:
                    # the pages as `handoff.export` lists them (a paired cache's window table first)
                    stream.block_ids = transfer_pages(entry.block_table, entry.window_table or ())
                    claimed.append(stream)
        if not claimed:
            return None
        self.num_claimed += len(claimed)
        loop = self._loop

        def post(layer: int, ready: torch.cuda.Event | None) -> None:
            try:
                loop.call_soon_threadsafe(_layer_done, claimed, layer, ready)
            except RuntimeError:  # the loop is closed: nobody sends any more
                pass

        return LayerProgress(self._num_layers, self._device, post)


def _layer_done(streams: list[LayerStream], layer: int, ready: torch.cuda.Event | None) -> None:
    for stream in streams:
        stream.layer_done(layer, ready)
