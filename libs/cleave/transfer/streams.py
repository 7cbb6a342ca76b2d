"""Ordering transfer work on CUDA streams, and waiting for it without blocking the event loop.

A sender is told where its KV comes from (`Ready`): "current_stream" (default) orders the
copy after the work queued on the caller's current stream; a `torch.cuda.Event` after that
event; "complete" when the producer already synchronized (e.g. the engine step that wrote the
KV has returned its sampled tokens to the host), so the copy starts at once. Every wait on
the device here is a device-side wait (`order_after`) or runs in a thread (`wait_stream`,
`run_on_device`), never on the event loop.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Literal, Union

import torch

from cleave.errors import InvalidArgument

Ready = Union[torch.cuda.Event, Literal["current_stream", "complete"]]


def order_after(stream: torch.cuda.Stream, ready: Ready, device: torch.device) -> None:
    """Make work queued next on `stream` start after the KV's producer (a device-side wait)."""
    if isinstance(ready, torch.cuda.Event):
        stream.wait_event(ready)
    elif ready == "current_stream":
        stream.wait_stream(torch.cuda.current_stream(device))
    elif ready != "complete":
        raise InvalidArgument(f"ready must be a CUDA event, 'current_stream' or 'complete', not {ready!r}", field="ready")


async def wait_stream(stream: torch.cuda.Stream) -> None:
    """Wait for the work queued on `stream` so far without blocking the event loop."""
    event = torch.cuda.Event()
    event.record(stream)
    await asyncio.to_thread(event.synchronize)


async def run_on_device(cache: torch.Tensor, work: Callable[[], None],
                        stream: torch.cuda.Stream | None = None) -> None:
    """Run `work` (it enqueues device work); on CUDA queue it on `stream` (default: the
    current one) and wait for it off the event loop."""
    if not cache.is_cuda:
        work()
        return
    stream = stream or torch.cuda.current_stream(cache.device)
    with torch.cuda.stream(stream):
        work()
        event = torch.cuda.Event()
        event.record(stream)
    await asyncio.to_thread(event.synchronize)
