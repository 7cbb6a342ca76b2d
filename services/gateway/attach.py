"""One Attach stream per decode worker, demultiplexed into per-request queues.

A decode worker sends one `StepOutput` per engine step holding the new tokens of every
request this gateway owns there; `AttachStream` reads it on a background task and drops
each `RequestDelta` into the queue of its request. A request registers its queue before it
is started, so no delta can arrive unclaimed; the worker keeps deltas published before the
stream is attached, so a request may start while the stream is still connecting.

When the stream breaks (the worker died, closed it, or `fail()` gave it up after its health
checks went unanswered), every waiting request gets a `WorkerLost` error after the deltas
that did arrive, naming the worker request it ends, so it can migrate elsewhere, and the
worker leaves the rotation. Several worker requests may share one queue (the samples of one
gateway request after they moved, each decoding on its own); each gets its own `WorkerLost`. When the
gateway closes the stream itself (shutdown), they get a plain `Unavailable`.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable

import grpc
import structlog

from cleave.errors import CleaveError, Unavailable
from cleave.proto.cleave.v1 import decode_pb2
from services.gateway.delta_queue import DeltaQueue
from services.gateway.workers import WorkerHandle

log = structlog.get_logger("cleave.gateway.attach")


class WorkerLost(Unavailable):
    """The decode worker's token stream broke: its requests there are gone (migrate them).

    Attributes:
        worker_request_id: the worker request this error was queued for ("" when raised
            before any was registered).
    """

    def __init__(self, message: str, worker_request_id: str = "") -> None:
        super().__init__(message)
        self.worker_request_id = worker_request_id


class AttachStream:
    """The token stream of one decode worker for one gateway.

    Args:
        worker: the decode worker.
        gateway_id: this gateway's stable id (the worker routes our requests' tokens by it).
        on_broken: awaited when the stream ends unexpectedly.
    """

    def __init__(
        self,
        worker: WorkerHandle,
        gateway_id: str,
        on_broken: Callable[[WorkerHandle], Awaitable[None]] | None = None,
    ) -> None:
        self.worker = worker
        self.gateway_id = gateway_id
        self._on_broken = on_broken
        self._queues: dict[str, DeltaQueue] = {}
        self._call: grpc.aio.UnaryStreamCall | None = None
        self._task: asyncio.Task[None] | None = None
        self._closing = False
        self._failure: str | None = None
        self.is_open = False

    def open(self) -> None:
        """Open the stream (the worker buffers our deltas until it is attached)."""
        self._call = self.worker.stub.Attach(decode_pb2.AttachRequest(gateway_id=self.gateway_id))
        self.is_open = True
        self._task = asyncio.create_task(self._read(self._call), name=f"attach-{self.worker.address}")

    async def close(self) -> None:
        self._closing = True
        self.is_open = False
        if self._call is not None:
            self._call.cancel()
        if self._task is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    def fail(self, reason: str) -> None:
        """Give the worker up (it stopped answering): waiting requests get `WorkerLost`."""
        if self._failure is None and self._call is not None and self.is_open:
            self._failure = reason
            self.is_open = False
            self._call.cancel()

    def register(self, request_id: str, queue: DeltaQueue | None = None) -> DeltaQueue:
        """A queue (`queue`, or a new one) that receives the request's RequestDelta messages
        (or an exception)."""
        if not self.is_open:
            raise Unavailable(f"decode worker {self.worker.address} has no open token stream")
        if queue is None:
            queue = DeltaQueue()
        self._queues[request_id] = queue
        return queue

    def unregister(self, request_id: str) -> None:
        self._queues.pop(request_id, None)

    async def _read(self, call: grpc.aio.UnaryStreamCall) -> None:
        # What the waiting requests get; an unexpected exception here loses the worker too.
        error: CleaveError = WorkerLost(f"the token stream of decode worker {self.worker.address} failed")
        try:
            async for step in call:
                if step.HasField("load"):
                    self.worker.load = step.load
                for delta in step.deltas:
                    queue = self._queues.get(delta.request_id)
                    if queue is not None:
                        queue.put_nowait(delta)  # copied or merged once queued behind another
            error = WorkerLost(f"decode worker {self.worker.address} closed its token stream")
        except asyncio.CancelledError:
            error = Unavailable("the gateway is shutting down")
        except grpc.RpcError as exc:
            error = WorkerLost(f"lost decode worker {self.worker.address}: {exc.code().name}")
        finally:
            if self._failure is not None and not self._closing:
                error = WorkerLost(f"lost decode worker {self.worker.address}: {self._failure}")
            self.is_open = False
            for request_id, queue in self._queues.items():
                queue.put_nowait(WorkerLost(error.message, request_id) if isinstance(error, WorkerLost) else error)
            self._queues.clear()
        if not self._closing:
            log.warning("attach stream broken", address=self.worker.address, error=str(error))
            if self._on_broken is not None:
                await self._on_broken(self.worker)
