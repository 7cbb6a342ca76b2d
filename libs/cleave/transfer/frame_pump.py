"""Control frames of device-side copies, written in order as the copies finish, no round trips.

A CUDA IPC sender launches each copy on its copy stream and hands the pump the layer range
with a `Completion` of that copy. The pump writes one frame per run of consecutive layers
whose copies are done: it waits for the oldest pending copy only, then takes every later one
that has already finished too and merges them (`coalesce`), so layers that finish together
travel as one frame. Nothing waits for the receiver per frame; the sender waits once, for its
verdict, at the end (`KVSender.finish`).

    pump = FramePump(write)            # write(layers: range) -> awaitable: one frame
    pump.submit(range(0, 4), done)     # returns at once
    await pump.flush()                 # every submitted frame written (or the write error)
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Protocol

import torch

from cleave.transfer.layer_frames import coalesce


class Completion(Protocol):
    """The end of some queued device work."""

    def query(self) -> bool:
        """Whether the work finished (never blocks)."""

    async def wait(self) -> None:
        """Return once the work finished, without blocking the event loop."""


class EventCompletion:
    """A recorded CUDA event as a `Completion`."""

    def __init__(self, event: torch.cuda.Event) -> None:
        self.event = event

    def query(self) -> bool:
        return self.event.query()

    async def wait(self) -> None:
        if not self.event.query():  # the copy is usually done by now: no thread hop then
            await asyncio.to_thread(self.event.synchronize)


class FramePump:
    """Writes `(layers, completion)` frames in submission order once each completion is done.

    Args:
        write: writes one frame for a run of layers (e.g. a chunk header on the socket).
    """

    def __init__(self, write: Callable[[range], Awaitable[None]]) -> None:
        self._write = write
        self._pending: deque[tuple[range, Completion]] = deque()
        self._task: asyncio.Task | None = None
        self._error: BaseException | None = None
        self.num_frames = 0

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    def submit(self, layers: range, completion: Completion) -> None:
        """Queue a frame for `layers`, to be written once `completion` is done."""
        if self._error is not None:
            raise self._error
        self._pending.append((layers, completion))
        if self._task is None or self._task.done():
            self._task = asyncio.ensure_future(self._run())

    async def _run(self) -> None:
        try:
            while self._pending:
                await self._pending[0][1].wait()
                ready = [self._pending.popleft()[0]]
                while self._pending and self._pending[0][1].query():
                    ready.append(self._pending.popleft()[0])
                for run in coalesce(ready):
                    await self._write(run)
                    self.num_frames += 1
        except BaseException as error:
            self._error = error
            raise

    async def flush(self) -> None:
        """Wait until every submitted frame is written; raises the first write error."""
        while self._task is not None and not self._task.done():
            await asyncio.wait({self._task})
        if self._error is not None:
            raise self._error

    async def close(self) -> None:
        """Stop writing; return once every submitted device copy has finished (the source
        blocks may be freed then, and no copy writes into the receiver any more)."""
        if self._task is not None and not self._task.done():
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        while self._pending:
            _, completion = self._pending.popleft()
            await completion.wait()
