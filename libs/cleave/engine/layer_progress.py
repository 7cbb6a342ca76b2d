"""`LayerProgress`: which decoder layers of a step's forward have queued their KV write.

    engine.watch_layers(output) -> LayerProgress | None     # step thread, before the launch
    runner.launch(..., layer_progress=progress)              # eager forward only:
        layer i's forward returns -> progress.on_layer_done(i)
        the forward returns       -> progress.finish()       # layers not reported yet
    progress -> listener(layer, ready)                        # still on the step thread

A listener learns a layer once its KV write is queued: on CUDA `ready` is an event recorded
on the compute stream right after that layer (work ordered after it reads the layer's KV
complete, while the next layers still run); on CPU the write is done when the layer's
forward returns, so `ready` is None. The listener runs on the step thread, inside the
forward: it must only hand the layer on (e.g. `loop.call_soon_threadsafe`), never wait.

Layers a step runs without the per-layer hook (a CUDA graph replay, the fused decode-batch
kernels that a prefill chunk of at most a few tokens takes) are reported by `finish`, with
one event after the whole forward: a listener always hears every layer once, in order.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

# listener(layer_index, ready): ready is the layer's CUDA event, None off CUDA
LayerListener = Callable[[int, "torch.cuda.Event | None"], None]


class LayerProgress:
    """Reports each layer of one step's forward to a listener, once, in order.

    Args:
        num_layers: the model's decoder layers.
        device: the device the forward runs on (CUDA: one event per reported layer).
        listener: called on the step thread with (layer_index, event or None).
    """

    def __init__(self, num_layers: int, device: torch.device, listener: LayerListener) -> None:
        self.num_layers = num_layers
        self.num_reported = 0
        self._device = torch.device(device)
        self._on_cuda = self._device.type == "cuda"
        self._listener = listener

    @property
    def is_complete(self) -> bool:
        return self.num_reported == self.num_layers

    def on_layer_done(self, layer_index: int) -> None:
        """Layer `layer_index`'s forward has queued its KV write (step thread)."""
        if layer_index != self.num_reported:
            raise RuntimeError(f"layer {layer_index} reported after {self.num_reported} layers; "
                               "layers must be reported once each, in order")
        self._report(layer_index, self._record())

    def finish(self) -> None:
        """The forward returned: report the layers not reported yet, after one event."""
        if self.is_complete:
            return
        ready = self._record()
        for layer_index in range(self.num_reported, self.num_layers):
            self._report(layer_index, ready)

    def _record(self) -> torch.cuda.Event | None:
        if not self._on_cuda:
            return None
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self._device))  # the forward's stream on its device
        return event

    def _report(self, layer_index: int, ready: torch.cuda.Event | None) -> None:
        self.num_reported += 1
        self._listener(layer_index, ready)
