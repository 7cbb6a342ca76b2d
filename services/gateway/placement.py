"""Where a request decodes: the decode worker it is placed on and that worker's Attach stream.

`DecodePlacement` keeps one `AttachStream` per healthy decode worker (opened as workers come
into rotation, failed when one is lost), picks a worker for each request (`routing.pick_decode`
over the workers whose stream is open), registers the request's queue on that worker's stream
before any Start, and detaches (and aborts) it when it ends or moves to another worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import uuid
from dataclasses import dataclass

import grpc
import structlog

from cleave.errors import CleaveError, Unavailable
from cleave.proto.cleave.v1 import common_pb2
from services.gateway.attach import AttachStream
from services.gateway.routing import pick_decode
from services.gateway.workers import WorkerHandle, WorkerPool

log = structlog.get_logger("cleave.gateway")
BLOCK_SIZE_ESTIMATE = 16  # for "does the prompt fit" routing only; workers decide for real


@dataclass
class RunningRequest:
    """A request in flight: its id on the workers, the decode worker that streams it and the
    queue its deltas arrive in (all three change when it migrates)."""

    worker_request_id: str
    decode: WorkerHandle
    stream: AttachStream
    queue: asyncio.Queue
    num_migrations: int = 0
    attached: bool = True  # registered on `stream` and counted in `decode.in_flight`


class DecodePlacement:
    """The gateway's decode workers' streams, and which request runs on which worker.

    Args:
        pool: the gateway's workers (health, load).
        gateway_id: this gateway's id on the workers' Attach streams.
    """

    def __init__(self, pool: WorkerPool, gateway_id: str) -> None:
        self.pool = pool
        self.gateway_id = gateway_id
        self.streams: dict[str, AttachStream] = {}
        self._background: set[asyncio.Task] = set()

    # ---- streams --------------------------------------------------------------------------

    async def on_worker_change(self, worker: WorkerHandle) -> None:
        """Open the Attach stream of a decode worker that came into rotation."""
        if worker.role != "decode" or not worker.healthy:
            return  # a draining worker still streams its running requests
        stream = self.streams.get(worker.address)
        if stream is not None and stream.is_open:
            return
        stream = AttachStream(worker, self.gateway_id, on_broken=self._on_stream_broken)
        stream.open()
        self.streams[worker.address] = stream

    async def on_worker_lost(self, worker: WorkerHandle) -> None:
        """Fail a lost decode worker's stream: its requests see `WorkerLost` and migrate."""
        stream = self.streams.get(worker.address)
        if worker.role == "decode" and stream is not None:
            stream.fail(f"{worker.failed_checks} health checks unanswered")

    async def _on_stream_broken(self, worker: WorkerHandle) -> None:
        await self.pool.set_healthy(worker, False)

    async def close(self) -> None:
        """Close every stream and wait for the aborts still being sent."""
        for stream in list(self.streams.values()):
            await stream.close()
        if self._background:
            await asyncio.gather(*self._background, return_exceptions=True)

    # ---- requests -------------------------------------------------------------------------

    def candidates(self) -> list[WorkerHandle]:
        """Decode workers in rotation whose stream is open."""
        return [
            w for w in self.pool.of_role("decode")
            if (stream := self.streams.get(w.address)) is not None and stream.is_open
        ]

    def place(self, num_prompt_tokens: int) -> RunningRequest:
        """Pick a decode worker and register a queue on its stream (before any Start)."""
        decode = pick_decode(self.candidates(), math.ceil((num_prompt_tokens + 1) / BLOCK_SIZE_ESTIMATE))
        if decode is None:
            raise Unavailable("no decode worker is in rotation; check the workers' health and retry")
        worker_request_id = f"req-{uuid.uuid4().hex}"
        stream = self.streams[decode.address]
        queue = stream.register(worker_request_id)
        decode.in_flight += 1
        return RunningRequest(worker_request_id, decode, stream, queue)

    def leave(self, running: RunningRequest, abort: bool) -> None:
        """Stop listening to the request's worker (and abort it there, unless it ended)."""
        if not running.attached:
            return
        running.attached = False
        running.stream.unregister(running.worker_request_id)
        running.decode.in_flight -= 1
        if abort:
            self.fire_abort(running.decode, running.worker_request_id)

    def move(
        self,
        request_id: str,
        running: RunningRequest,
        num_prompt_tokens: int,
        reason: CleaveError,
        num_generated: int,
        max_migrations: int,
    ) -> None:
        """Point a detached request at a new decode worker (raises Unavailable when it may
        not move again or no worker is left)."""
        if running.num_migrations >= max_migrations:
            raise Unavailable(f"{reason}; the request already moved {running.num_migrations} time(s), retry it")
        moved = self.place(num_prompt_tokens)
        log.warning(
            "request migrated", request_id=request_id, lost_worker=running.decode.address,
            new_worker=moved.decode.address, num_generated=num_generated,
            migration=running.num_migrations + 1, reason=str(reason),
        )
        running.worker_request_id, running.decode = moved.worker_request_id, moved.decode
        running.stream, running.queue = moved.stream, moved.queue
        running.num_migrations += 1
        running.attached = True

    def fire_abort(self, decode: WorkerHandle, worker_request_id: str, sample_index: int | None = None) -> None:
        """Abort a request (or one of its samples) on its worker without waiting."""

        async def abort() -> None:
            with contextlib.suppress(grpc.RpcError):
                await decode.stub.Abort(
                    common_pb2.AbortRequest(request_id=worker_request_id, sample_index=sample_index), timeout=5.0
                )

        task = asyncio.create_task(abort())
        self._background.add(task)
        task.add_done_callback(self._background.discard)
