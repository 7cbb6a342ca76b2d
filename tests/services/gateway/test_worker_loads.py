"""The gateway's worker pool asks prefill workers for their load between health checks (their
queues change by whole prompts other gateways send), keeps the last load when a call fails,
and does so only where the load chooses something."""

from __future__ import annotations

import asyncio

import grpc
from grpc_health.v1 import health_pb2

from cleave.config import ModelConfig
from cleave.proto.cleave.v1 import common_pb2
from services.gateway.model import ServedModel
from services.gateway.router import GatewayOptions, RoutingBackend
from services.gateway.workers import PoolOptions, WorkerHandle, WorkerPool


class FakeWorker:
    """A worker's stub, health stub and channel: GetLoad answers a queue that grows by one
    prompt token per call, or fails while `failing` is set."""

    def __init__(self) -> None:
        self.load_calls = 0
        self.failing = False

    async def GetLoad(self, request: common_pb2.GetLoadRequest, timeout: float | None = None):  # noqa: N802
        self.load_calls += 1
        if self.failing:
            raise grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata())
        return common_pb2.GetLoadResponse(load=common_pb2.WorkerLoad(num_queued_prompt_tokens=self.load_calls))

    async def Check(self, request: health_pb2.HealthCheckRequest, timeout: float | None = None):  # noqa: N802
        return health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVING)

    async def close(self) -> None:
        pass


async def wait_until(predicate, timeout_s: float = 60.0) -> None:  # type: ignore[no-untyped-def]
    async def poll() -> None:
        while not predicate():
            await asyncio.sleep(0.005)

    await asyncio.wait_for(poll(), timeout_s)


async def start_pool(options: PoolOptions) -> tuple[WorkerPool, dict[str, FakeWorker]]:
    fakes: dict[str, FakeWorker] = {}
    pool = WorkerPool(["p:1"], ["d:1"], options)

    def handle(role, address):  # type: ignore[no-untyped-def]
        fake = fakes[address] = FakeWorker()
        return WorkerHandle(role, address, fake, fake, fake)  # type: ignore[arg-type]

    pool._handle = handle  # type: ignore[method-assign]
    await pool.start()
    return pool, fakes


async def test_prefill_loads_refresh_between_health_checks_and_survive_a_failed_call():
    pool, fakes = await start_pool(PoolOptions(health_interval_s=3600.0, prefill_load_interval_s=0.01))
    try:
        (prefill,) = pool.of_role("prefill")
        (decode,) = pool.of_role("decode")
        await wait_until(lambda: prefill.load.num_queued_prompt_tokens >= 3)
        assert fakes["d:1"].load_calls == 1  # decode loads come with step outputs: only the first check
        fakes["p:1"].failing = True
        last = prefill.load.num_queued_prompt_tokens
        calls = fakes["p:1"].load_calls
        await wait_until(lambda: fakes["p:1"].load_calls >= calls + 2)
        assert prefill.load.num_queued_prompt_tokens == last and prefill.healthy
    finally:
        await pool.close()
    assert pool._load_poller is not None and pool._load_poller.done()


async def test_an_interval_of_zero_leaves_prefill_loads_to_the_health_checks():
    pool, fakes = await start_pool(PoolOptions(health_interval_s=3600.0, prefill_load_interval_s=0))
    try:
        assert pool._load_poller is None and fakes["p:1"].load_calls == 1
    finally:
        await pool.close()


def test_the_gateway_polls_prefill_loads_only_where_they_choose_something(model_dir):
    model = ServedModel(ModelConfig(source=str(model_dir), served_name="tiny", max_context_length=256))
    unreachable = "127.0.0.1:9"

    def interval(mode: str, num_prefill: int) -> float:
        backend = RoutingBackend(model, [unreachable] * num_prefill, [unreachable], GatewayOptions(mode=mode))
        return backend.pool.options.prefill_load_interval_s

    assert interval("disaggregated", 1) == 0  # one prefill worker: nothing to choose
    assert interval("disaggregated", 2) == PoolOptions().prefill_load_interval_s > 0
    assert interval("conditional", 1) == PoolOptions().prefill_load_interval_s  # local or remote
