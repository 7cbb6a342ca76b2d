"""A worker that hangs (SIGSTOPped: its connections stay open, nothing answers) while a
request's start waits on it. Once the gateway declares it lost (its health checks went
unanswered), every start in flight there gives up and runs on another worker: as the prefill
worker, on the other prefill worker; as the decode worker (the target of a prefill worker's
Admit, or of a colocated Start), on the other decode worker. A worker's own call timing out
is that worker failing (retried), never the client's DEADLINE_EXCEEDED. The client's tokens
equal an undisturbed greedy run and every pool ends full.

A hang is a backend method that blocks on an event; unanswered health checks are a health
stub that fails each check at once, so the gateway's monitor loses the worker within two
check intervals, with no fixed sleep anywhere."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
import pytest
import structlog

from cleave.client import GatewayClient
from cleave.errors import DeadlineExceeded, Unavailable
from cleave.generation.sampling_params import SamplingParams
from cleave.proto.cleave.v1 import common_pb2, gateway_pb2 as g
from cleave.rpc.errors import ERROR_DETAIL_KEY
from services.gateway.worker_rpc import call_worker
from services.gateway.workers import WorkerHandle
from tests.services.gateway.helpers import assert_decode_pools_full, reference_llm
from tests.services.gateway.stack import Stack, start_stack

MAX_TOKENS = 16
IDS = g.StreamOptions(include_token_ids=True)
CLIENT_TIMEOUT_S = 120.0  # the client's deadline, as in the fault probe: far beyond any hop's
# A guard, not a wait: these requests end within a second once the worker is lost; before
# the fix they waited for the hung worker (forever) or for a 30 s control timeout.
GUARD_S = 20.0
PROMPTS = [f"Hung {index}: a prompt that waits on a stopped worker" for index in range(3)]


class Hang:
    """Makes `backend.<method>` block, as on a stopped process: `entered` is set once a call
    waits there, `cancelled` once a waiting call was cancelled (its caller gave up);
    `release()` lets waiting and later calls through to the real method."""

    def __init__(self, backend: Any, method: str) -> None:
        self.backend, self.method = backend, method
        self.real = getattr(backend, method)
        self.entered = asyncio.Event()
        self.cancelled = asyncio.Event()
        self._released = asyncio.Event()
        setattr(backend, method, self._blocked)

    async def _blocked(self, *args: Any, **kwargs: Any) -> Any:
        self.entered.set()
        try:
            await self._released.wait()
        except asyncio.CancelledError:
            self.cancelled.set()
            raise
        return await self.real(*args, **kwargs)

    def release(self) -> None:
        self._released.set()
        vars(self.backend).pop(self.method, None)


class Unanswered:
    """A health stub whose checks all time out: the worker is hung, not shut down."""

    async def Check(self, request: Any, timeout: float | None = None) -> Any:
        raise grpc.aio.AioRpcError(grpc.StatusCode.DEADLINE_EXCEEDED, grpc.aio.Metadata(), grpc.aio.Metadata(),
                                   details="injected: the worker does not answer")


class Faults:
    """Hangs and silenced health checks of one test, undone on every way out."""

    def __init__(self) -> None:
        self.hangs: list[Hang] = []
        self.silenced: list[tuple[WorkerHandle, Any]] = []

    def hang(self, backend: Any, method: str) -> Hang:
        hang = Hang(backend, method)
        self.hangs.append(hang)
        return hang

    def stop_answering(self, worker: WorkerHandle) -> None:
        self.silenced.append((worker, worker.health))
        worker.health = Unanswered()

    def undo(self) -> None:
        """Release every hang and restore every health stub (again: a no-op)."""
        for hang in self.hangs:
            hang.release()
        for worker, health in self.silenced:
            worker.health = health
        self.silenced.clear()


def _expected(model_dir, prompts: list[str]) -> list[list[int]]:  # type: ignore[no-untyped-def]
    outputs = reference_llm(model_dir).generate(
        prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True))
    return [output.outputs[0].token_ids for output in outputs]


async def _complete(stack: Stack, prompts: list[str]) -> list[list[int]]:
    async with GatewayClient(stack.gateway_address) as client, asyncio.timeout(GUARD_S):
        results = await asyncio.gather(*(
            client.complete(prompt, timeout=CLIENT_TIMEOUT_S, max_tokens=MAX_TOKENS, temperature=0.0,
                            ignore_eos=True, stream=IDS)
            for prompt in prompts))
    return [result.samples[0].token_ids for result in results]


async def _lose_when_entered(hang: Hang, worker: WorkerHandle, faults: Faults) -> None:
    """Once a start waits on the hung worker, its health checks stop being answered."""
    await hang.entered.wait()
    faults.stop_answering(worker)


async def test_starts_on_a_hung_prefill_worker_move_to_the_other_once_it_is_lost(model_dir):
    stack = await start_stack(model_dir, "disaggregated", num_prefill=2, health_interval_s=0.1)
    faults = Faults()
    try:
        assert stack.router is not None
        hung, alive = stack.router.pool.of_role("prefill")
        # after its Admit went out: the decode worker holds a reservation for the hung request
        hang = faults.hang(stack.prefill[0], "_run_prefill")
        with structlog.testing.capture_logs() as logs:
            losing = asyncio.ensure_future(_lose_when_entered(hang, hung, faults))
            try:
                tokens = await _complete(stack, PROMPTS)
            finally:
                losing.cancel()
        assert tokens == _expected(model_dir, PROMPTS)
        assert hang.cancelled.is_set()  # the gateway gave up its call on the hung worker
        retried = [entry for entry in logs if entry["event"] == "prefill failed; retrying on another prefill worker"]
        assert retried and {entry["prefill"] for entry in retried} == {hung.address}
        assert all("is lost" in entry["reason"] for entry in retried)
        assert (hung.healthy, alive.healthy) == (False, True)
        await assert_decode_pools_full(stack)
    finally:
        faults.undo()
        await stack.close()


@pytest.mark.parametrize(("mode", "method"), [("disaggregated", "admit"), ("colocated", "start_request")])
async def test_starts_on_a_hung_decode_worker_move_to_the_other_once_it_is_lost(model_dir, mode, method):
    """Disaggregated: the prefill worker waits on the hung decode worker's Admit (and the
    gateway on the Prefill); colocated: the gateway waits on its Start."""
    stack = await start_stack(model_dir, mode, num_decode=2, health_interval_s=0.1)
    faults = Faults()
    try:
        assert stack.router is not None
        hung, survivor = stack.router.pool.of_role("decode")
        survivor.in_flight += 10  # placement picks the hung worker first
        try:
            hang = faults.hang(stack.decode[0], method)
            with structlog.testing.capture_logs() as logs:
                losing = asyncio.ensure_future(_lose_when_entered(hang, hung, faults))
                try:
                    tokens = await _complete(stack, PROMPTS[:1])
                finally:
                    losing.cancel()
        finally:
            survivor.in_flight -= 10
        assert tokens == _expected(model_dir, PROMPTS[:1])
        (moved,) = [entry for entry in logs if entry["event"] == "request migrated"]
        assert moved["lost_worker"] == hung.address and moved["new_worker"] == survivor.address
        assert "is lost" in moved["reason"]
        # The hung worker wakes: what it admits for the abandoned start is aborted (or expires).
        hang.release()
        await assert_decode_pools_full(stack)
    finally:
        faults.undo()
        await stack.close()


async def test_a_decode_worker_whose_admit_times_out_is_moved_off_not_a_client_deadline(model_dir):
    """The prefill worker's Admit runs past its control timeout (DEADLINE_EXCEEDED on that
    hop): the decode worker failed, the request moves; the client's own deadline is far."""
    stack = await start_stack(model_dir, "disaggregated", num_decode=2, health_interval_s=0.2)
    try:
        assert stack.router is not None
        slow, survivor = stack.router.pool.of_role("decode")
        survivor.in_flight += 10  # placement picks the slow worker first
        links = stack.prefill[0].decode_links
        real_stub = links.stub

        class TimesOut:
            async def Admit(self, request: Any, timeout: float | None = None) -> Any:
                raise grpc.aio.AioRpcError(grpc.StatusCode.DEADLINE_EXCEEDED, grpc.aio.Metadata(),
                                           grpc.aio.Metadata(), details="Deadline Exceeded")

        links.stub = lambda address: TimesOut() if address == slow.address else real_stub(address)
        try:
            with structlog.testing.capture_logs() as logs:
                tokens = await _complete(stack, PROMPTS[:1])
        finally:
            links.stub = real_stub
            survivor.in_flight -= 10
        assert tokens == _expected(model_dir, PROMPTS[:1])
        (moved,) = [entry for entry in logs if entry["event"] == "request migrated"]
        assert moved["lost_worker"] == slow.address and "Admit on decode worker" in moved["reason"]
        assert slow.healthy  # one slow admission is no health verdict
        await assert_decode_pools_full(stack)
    finally:
        await stack.close()


async def test_a_prefill_worker_reporting_its_own_deadline_is_retried_on_the_other(model_dir):
    stack = await start_stack(model_dir, "disaggregated", num_prefill=2, health_interval_s=30.0)
    try:
        assert stack.router is not None
        failing, alive = stack.router.pool.of_role("prefill")
        calls = 0

        async def times_out(*args: Any, **kwargs: Any) -> Any:
            nonlocal calls
            calls += 1
            raise DeadlineExceeded("injected: a call this worker made to its kvstore timed out")

        stack.prefill[0].prefill = times_out  # least loaded and first: the first request goes there
        try:
            with structlog.testing.capture_logs() as logs:
                tokens = await _complete(stack, PROMPTS[:1])
        finally:
            del stack.prefill[0].prefill
        assert calls == 1
        assert tokens == _expected(model_dir, PROMPTS[:1])
        (retried,) = [entry for entry in logs if entry["event"] == "prefill failed; retrying on another prefill worker"]
        assert retried["prefill"] == failing.address and "DEADLINE_EXCEEDED" in retried["reason"]
        assert (failing.healthy, alive.healthy) == (True, True)
        await assert_decode_pools_full(stack)
    finally:
        await stack.close()


class _Pool:
    """What `call_worker` asks of a WorkerPool."""

    def is_lost(self, worker: WorkerHandle) -> bool:
        return False

    async def set_healthy(self, worker: WorkerHandle, healthy: bool) -> None:
        worker.healthy = healthy


async def test_deadline_exceeded_is_the_clients_only_when_its_deadline_ran_out():
    worker = WorkerHandle("prefill", "prefill:1", None, None, None, healthy=True)  # type: ignore[arg-type]
    detail = common_pb2.ErrorDetail(code=common_pb2.ERROR_CODE_DEADLINE_EXCEEDED, message="Admit timed out")

    async def fails(reported_by_worker: bool) -> None:
        trailing = grpc.aio.Metadata((ERROR_DETAIL_KEY, detail.SerializeToString())) if reported_by_worker \
            else grpc.aio.Metadata()
        raise grpc.aio.AioRpcError(grpc.StatusCode.DEADLINE_EXCEEDED, grpc.aio.Metadata(), trailing,
                                   details="Admit on decode worker d:1: Deadline Exceeded")

    pool: Any = _Pool()
    now = asyncio.get_running_loop().time()
    for reported, deadline in [(True, now + 60.0), (True, None), (False, None)]:
        with pytest.raises(Unavailable):  # a call the worker made timed out: retry elsewhere
            await call_worker(pool, fails(reported), worker, "Prefill", deadline=deadline)
    for reported in (True, False):
        with pytest.raises(DeadlineExceeded):  # the request's own deadline ran out
            await call_worker(pool, fails(reported), worker, "Prefill", deadline=now - 0.001)
    assert worker.healthy  # a timed-out call is no health verdict
