"""Where a request decodes: the decode workers it runs on and their Attach streams.

`DecodePlacement` keeps one `AttachStream` per healthy decode worker (opened as workers come
into rotation, failed when one is lost), picks a worker for each worker request
(`routing.pick_decode` over the workers whose stream is open), registers the request's queue
on that worker's stream before any Start, and detaches (and aborts) it when it ends or moves.

A gateway request (`RunningRequest`) runs as one or more worker requests (`WorkerRequest`):
one for all of its n samples when it starts (they share the prompt's KV); after a migration,
one per moved sample, since each sample continues from its own tokens. All of them feed the
request's one queue; each worker request maps its worker-side sample indices back to the
request's.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import grpc

from cleave.errors import CleaveError, Unavailable
from cleave.proto.cleave.v1 import common_pb2, decode_pb2
from services.gateway.attach import AttachStream, WorkerLost
from services.gateway.delta_queue import DeltaQueue
from services.gateway.routing import pick_decode
from services.gateway.workers import WorkerHandle, WorkerPool

BLOCK_SIZE_ESTIMATE = 16  # for "does the prompt fit" routing only; workers decide for real


@dataclass
class WorkerRequest:
    """One request on one decode worker: its id there, the worker, the stream its deltas come
    on, and the gateway request's samples it decodes (worker sample j is request sample
    `sample_indices[j]`)."""

    worker_request_id: str
    decode: WorkerHandle
    stream: AttachStream
    sample_indices: tuple[int, ...]
    attached: bool = True  # registered on `stream` and counted in `decode.in_flight`
    # the rest of a disaggregated start after its first tokens (`starts.follow_handoff`;
    # True once the KV was delivered and the decode started)
    handoff: asyncio.Future[bool] | None = None

    @property
    def handoff_delivered(self) -> bool:
        """No handoff, or one that delivered the KV (not pending, failed or cancelled)."""
        handoff = self.handoff
        return handoff is None or (handoff.done() and not handoff.cancelled() and handoff.result())


@dataclass
class RunningRequest:
    """A gateway request in flight: the worker requests decoding its samples (keyed by their
    worker request id; they change when it migrates), the queue all their deltas arrive in,
    and how many times it moved."""

    queue: DeltaQueue
    parts: dict[str, WorkerRequest] = field(default_factory=dict)
    num_migrations: int = 0

    @property
    def decode(self) -> WorkerHandle:
        """The decode worker of the request's first worker request (for logs and tests)."""
        return next(iter(self.parts.values())).decode

    def add(self, part: WorkerRequest) -> None:
        self.parts[part.worker_request_id] = part

    def request_sample(self, worker_request_id: str, worker_sample_index: int) -> int | None:
        """The request's sample index of a worker's delta; None for a worker request it left."""
        part = self.parts.get(worker_request_id)
        if part is None or not 0 <= worker_sample_index < len(part.sample_indices):
            return None
        return part.sample_indices[worker_sample_index]

    def lost_in_handoff(self, delta: decode_pb2.RequestDelta) -> WorkerLost | None:
        """The `WorkerLost` of a worker request that its decode worker ended (ABORT) before
        the KV handoff to it delivered: the decode never started (the prefill worker gave up
        the reservation, or it expired), so its samples move as if the worker were lost
        (whichever of this and the handoff's own failure comes first moves them)."""
        part = self.parts.get(delta.request_id)
        if part is None or part.handoff_delivered or delta.finish_reason != common_pb2.FINISH_REASON_ABORT:
            return None
        return WorkerLost(f"decode worker {part.decode.address} dropped the request while its KV was on the "
                          "way (the prefill worker gave it up)", delta.request_id)

    def part_of(self, sample_index: int) -> tuple[WorkerRequest, int] | None:
        """The worker request decoding a sample, and the sample's index there."""
        for part in self.parts.values():
            if sample_index in part.sample_indices:
                return part, part.sample_indices.index(sample_index)
        return None


class DecodePlacement:
    """The gateway's decode workers' streams, and which request runs on which worker.

    Args:
        pool: the gateway's workers (health, load).
        gateway_id: this gateway's id on the workers' Attach streams.
        on_stream_closed: awaited after a worker's stream broke (and the worker left the
            rotation), so the owner can see `candidates()` shrink.
    """

    def __init__(
        self, pool: WorkerPool, gateway_id: str,
        on_stream_closed: Callable[[WorkerHandle], Awaitable[None]] | None = None,
    ) -> None:
        self.pool = pool
        self.gateway_id = gateway_id
        self._on_stream_closed = on_stream_closed
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
        if self._on_stream_closed is not None:  # also when the worker had left the rotation already
            await self._on_stream_closed(worker)

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

    def place(self, num_prompt_tokens: int, num_samples: int) -> RunningRequest:
        """Place a new request's samples as one worker request (they share the prompt's KV)."""
        running = RunningRequest(DeltaQueue())
        running.add(self.place_samples(num_prompt_tokens, tuple(range(num_samples)), running.queue))
        return running

    def place_samples(
        self, num_prompt_tokens: int, sample_indices: tuple[int, ...], queue: DeltaQueue,
        avoid: WorkerHandle | None = None,
    ) -> WorkerRequest:
        """Pick a decode worker for some of a request's samples and register the request's
        queue on its stream under a new worker request id (before any Start); `avoid` is
        used only when no other worker is in rotation."""
        candidates = self.candidates()
        others = [worker for worker in candidates if worker is not avoid]
        decode = pick_decode(others or candidates, math.ceil((num_prompt_tokens + 1) / BLOCK_SIZE_ESTIMATE))
        if decode is None:
            raise Unavailable("no decode worker is in rotation; check the workers' health and retry")
        return self._register(decode, sample_indices, queue)

    def _register(self, decode: WorkerHandle, sample_indices: tuple[int, ...], queue: DeltaQueue) -> WorkerRequest:
        worker_request_id = f"req-{uuid.uuid4().hex}"
        stream = self.streams[decode.address]
        stream.register(worker_request_id, queue)
        decode.in_flight += 1
        return WorkerRequest(worker_request_id, decode, stream, sample_indices)

    def renew(self, running: RunningRequest, part: WorkerRequest) -> WorkerRequest:
        """Give a worker request a new id on the same decode worker, leaving (and aborting)
        the old one: a start that failed half-way may have left a reservation under the old
        id there, which the abort frees and which the next start must not collide with."""
        renewed = self._register(part.decode, part.sample_indices, running.queue)  # raises before leaving
        self.leave(running, part, abort=True)
        running.add(renewed)
        return renewed

    def leave(self, running: RunningRequest, part: WorkerRequest, abort: bool) -> None:
        """Stop listening to a worker request (and abort it there, unless it ended); its
        deltas still queued are dropped (`RunningRequest.request_sample` no longer knows it)."""
        running.parts.pop(part.worker_request_id, None)
        if part.handoff is not None:
            part.handoff.cancel()  # a no-op once the KV was delivered
        if not part.attached:
            return
        part.attached = False
        part.stream.unregister(part.worker_request_id)
        part.decode.in_flight -= 1
        if abort:
            self.fire_abort(part.decode, part.worker_request_id)

    def leave_all(self, running: RunningRequest, finished: Callable[[int], bool]) -> None:
        """Leave every worker request; abort those with a sample not `finished` on its worker."""
        for part in list(running.parts.values()):
            self.leave(running, part, abort=not all(finished(i) for i in part.sample_indices))

    @staticmethod
    def count_move(running: RunningRequest, reason: CleaveError, max_migrations: int) -> None:
        """Count one more migration of the request (raises Unavailable when it may not move
        again)."""
        if running.num_migrations >= max_migrations:
            raise Unavailable(
                f"{reason}; the request already moved {running.num_migrations} time(s) "
                f"(max_migrations={max_migrations}), retry it"
            )
        running.num_migrations += 1

    def fire_abort(self, decode: WorkerHandle, worker_request_id: str, sample_index: int | None = None) -> None:
        """Abort a request (or one of its samples) on its worker without waiting."""

        async def abort() -> None:
            with contextlib.suppress(grpc.RpcError, grpc.aio.UsageError):  # UsageError: the gateway stopped
                await decode.stub.Abort(
                    common_pb2.AbortRequest(request_id=worker_request_id, sample_index=sample_index), timeout=5.0
                )

        task = asyncio.create_task(abort())
        self._background.add(task)
        task.add_done_callback(self._background.discard)
