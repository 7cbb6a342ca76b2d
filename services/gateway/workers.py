"""The gateway's view of its workers: channels, health, load, and rotation.

Every configured worker gets one channel. A monitor task asks each worker's
`grpc.health.v1` service and `GetLoad` every `health_interval_s`; a worker that is not
SERVING (or does not answer in `check_timeout_s`) leaves the rotation and comes back once it
reports SERVING again. A worker that answered NOT_SERVING is draining and still finishes what
it runs; one that has not answered `lost_after_failed_checks` checks in a row is lost: every
call still waiting on it gives up (`WorkerHandle.next_loss`: a hung worker never answers
them, and nothing else would end a call without a deadline), and `on_lost` is told (the
gateway migrates its requests). Routing reads `WorkerHandle.load` (last poll) plus the live count of
requests this gateway routed there (`in_flight`), which is fresher than any poll. A prefill
worker's queue changes by whole prompts that other gateways send, so its load alone is asked
again every `prefill_load_interval_s` (a decode worker's comes with its step outputs).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import grpc
import structlog
from grpc_health.v1 import health_pb2, health_pb2_grpc

from cleave.proto.cleave.v1 import common_pb2, decode_pb2_grpc, prefill_pb2_grpc
from cleave.rpc.client import aio_channel, tls_credentials
from cleave.tls import TlsConfig

Role = Literal["prefill", "decode"]
_SERVING = health_pb2.HealthCheckResponse.SERVING
log = structlog.get_logger("cleave.gateway.workers")


@dataclass(frozen=True)
class PoolOptions:
    """How workers are reached, and how often and how patiently they are checked."""

    health_interval_s: float = 1.0
    prefill_load_interval_s: float = 0.1  # 0: prefill loads only with the health checks
    check_timeout_s: float = 2.0
    lost_after_failed_checks: int = 2  # unanswered checks in a row before a worker is lost
    internal_token: str | None = field(default=None, repr=False)  # sent on every call to a worker
    tls: TlsConfig | None = None  # calls to workers go over TLS with it (`cleave.tls`)


@dataclass(eq=False)
class WorkerHandle:
    """One worker: its stubs, last known load and whether it is in rotation."""

    role: Role
    address: str
    channel: grpc.aio.Channel
    stub: Any  # PrefillStub or DecodeStub
    health: health_pb2_grpc.HealthStub
    healthy: bool = False
    load: common_pb2.WorkerLoad = field(default_factory=common_pb2.WorkerLoad)
    in_flight: int = 0  # requests this gateway routed here that have not ended
    in_flight_prompt_tokens: int = 0  # prompt tokens sent here and not yet prefilled
    failed_checks: int = 0  # health checks in a row that got no answer
    _next_loss: asyncio.Future[None] | None = field(default=None, init=False, repr=False)

    @property
    def worker_id(self) -> str:
        return self.load.worker_id or self.address

    def next_loss(self) -> asyncio.Future[None]:
        """Done when the pool next declares this worker lost; calls in flight to it wait on
        this beside their answer (`worker_rpc.call_worker`). One future serves every waiter."""
        if self._next_loss is None:
            self._next_loss = asyncio.get_running_loop().create_future()
        return self._next_loss

    def declare_lost(self) -> None:
        """End the waits of `next_loss`; a call made from now on waits for a later loss."""
        loss, self._next_loss = self._next_loss, None
        if loss is not None and not loss.done():
            loss.set_result(None)


ChangeCallback = Callable[[WorkerHandle], Awaitable[None]]


class WorkerPool:
    """All prefill and decode workers of one gateway.

    Args:
        prefill_addresses / decode_addresses: host:port of each worker.
        options: check cadence.
        on_change: awaited after a worker enters or leaves the rotation.
        on_lost: awaited when a worker stopped answering health checks.
    """

    def __init__(
        self,
        prefill_addresses: Sequence[str],
        decode_addresses: Sequence[str],
        options: PoolOptions = PoolOptions(),
        on_change: ChangeCallback | None = None,
        on_lost: ChangeCallback | None = None,
    ) -> None:
        self.options = options
        self._on_change = on_change
        self._on_lost = on_lost
        self._addresses = [("prefill", a) for a in prefill_addresses] + [("decode", a) for a in decode_addresses]
        self.workers: list[WorkerHandle] = []  # channels belong to the serving loop: made in start()
        self._monitor: asyncio.Task[None] | None = None
        self._load_poller: asyncio.Task[None] | None = None

    def _handle(self, role: Role, address: str) -> WorkerHandle:
        channel = aio_channel(address, internal_token=self.options.internal_token,
                              credentials=tls_credentials(self.options.tls))
        stub = (prefill_pb2_grpc.PrefillStub if role == "prefill" else decode_pb2_grpc.DecodeStub)(channel)
        return WorkerHandle(role, address, channel, stub, health_pb2_grpc.HealthStub(channel))

    def of_role(self, role: Role, healthy_only: bool = True) -> list[WorkerHandle]:
        return [w for w in self.workers if w.role == role and (w.healthy or not healthy_only)]

    async def start(self) -> None:
        """Connect, check every worker once, then keep checking in the background."""
        self.workers = [self._handle(role, address) for role, address in self._addresses]  # type: ignore[arg-type]
        await self.check_all()
        self._monitor = asyncio.create_task(self._run(), name="gateway-worker-monitor")
        if self.options.prefill_load_interval_s > 0 and self.of_role("prefill", healthy_only=False):
            self._load_poller = asyncio.create_task(self._poll_prefill_loads(), name="gateway-prefill-loads")

    async def close(self) -> None:
        for task in (self._monitor, self._load_poller):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        for worker in self.workers:
            await worker.channel.close()

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.options.health_interval_s)
            await self.check_all()

    async def _poll_prefill_loads(self) -> None:
        while True:
            await asyncio.sleep(self.options.prefill_load_interval_s)
            await asyncio.gather(*(self._refresh_load(worker) for worker in self.of_role("prefill")))

    async def _refresh_load(self, worker: WorkerHandle) -> None:
        """The worker's load now; a call that fails leaves the last one (health checks decide
        whether the worker is still there)."""
        with contextlib.suppress(grpc.RpcError):
            reply = await worker.stub.GetLoad(common_pb2.GetLoadRequest(), timeout=self.options.check_timeout_s)
            worker.load = reply.load

    async def check_all(self) -> None:
        await asyncio.gather(*(self._check(worker) for worker in self.workers))

    async def _check(self, worker: WorkerHandle) -> None:
        timeout = self.options.check_timeout_s
        try:
            status = await worker.health.Check(health_pb2.HealthCheckRequest(service=""), timeout=timeout)
            serving = status.status == _SERVING
            if serving:
                worker.load = (await worker.stub.GetLoad(common_pb2.GetLoadRequest(), timeout=timeout)).load
            worker.failed_checks = 0
        except grpc.RpcError:
            serving = False
            worker.failed_checks += 1
        await self.set_healthy(worker, serving)
        if worker.failed_checks == self.options.lost_after_failed_checks:
            log.warning("worker lost: health checks unanswered", role=worker.role, address=worker.address,
                        failed_checks=worker.failed_checks)
            worker.declare_lost()  # first: the starts in flight there give up and retry elsewhere
            if self._on_lost is not None:
                await self._on_lost(worker)

    def is_lost(self, worker: WorkerHandle) -> bool:
        """Whether the worker was declared lost and has not answered a health check since."""
        return worker.failed_checks >= self.options.lost_after_failed_checks

    async def set_healthy(self, worker: WorkerHandle, healthy: bool) -> None:
        """Put a worker into or out of rotation (and tell the owner when that changed)."""
        if worker.healthy == healthy:
            return
        worker.healthy = healthy
        log.info("worker in rotation" if healthy else "worker out of rotation",
                 role=worker.role, address=worker.address)
        if self._on_change is not None:
            await self._on_change(worker)
