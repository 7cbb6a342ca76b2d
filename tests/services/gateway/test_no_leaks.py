"""Every way a request ends frees its KV blocks on every worker, exactly once: many requests
that finish, are cancelled at every stage (before the first token: during Admit, Prefill,
the KV transfer or Start; or mid-stream), time out, or lose their KV transfer, all at once.
Afterwards every worker's pool is full and nothing runs. A cancelled colocated request stops
decoding within a step of its abort."""

from __future__ import annotations

import asyncio
import random

import grpc
import pytest

from cleave.client import GatewayClient
from cleave.client.gateway import collect
from cleave.proto.cleave.v1 import gateway_pb2 as g
from tests.services.gateway.helpers import wait_for_free_blocks
from tests.services.gateway.stack import Stack, start_stack

NUM_REQUESTS = 120
CONCURRENCY = 12
IDS = g.StreamOptions(include_token_ids=True)
KINDS = ("finish", "cancel_early", "cancel_streaming", "timeout")


def break_some_transfers(monkeypatch, seed: int, probability: float) -> None:  # type: ignore[no-untyped-def]
    """Bulk KV writes fail now and then (ConnectionResetError): transfers torn mid-way."""
    from cleave.transfer import connection

    rng = random.Random(seed)
    real_write = connection.BulkConnection.write_chunk

    async def sometimes_break(bulk, header, payload=None):  # type: ignore[no-untyped-def]
        if rng.random() < probability:
            raise ConnectionResetError("injected: connection reset mid-transfer")
        await real_write(bulk, header, payload)

    monkeypatch.setattr(connection.BulkConnection, "write_chunk", sometimes_break)


async def one_request(client: GatewayClient, index: int, kind: str, rng: random.Random) -> str:
    """Run one request the way `kind` says; returns how it ended."""
    max_tokens = rng.randint(2, 24)
    timeout = rng.uniform(0.01, 0.3) if kind == "timeout" else 60.0
    call = client.generate(f"Request {index}: " + "word " * rng.randint(1, 40), max_tokens=max_tokens,
                           temperature=0.0, ignore_eos=True, stream=IDS, request_id=f"r{index}", timeout=timeout)
    try:
        if kind == "cancel_early":
            await asyncio.sleep(rng.uniform(0.0, 0.05))  # somewhere in tokenize, Admit, Prefill, transfer, Start
            call.cancel()
            await collect(call)
            return "finished"  # it beat the cancel
        if kind == "cancel_streaming":
            async for response in call:
                if any(sample.token_ids for sample in response.samples):
                    call.cancel()
            return "finished"
        result = await collect(call)
        (sample,) = result.samples
        assert sample.finish_reason == "length" and len(sample.token_ids) == max_tokens, result
        return "finished"
    except asyncio.CancelledError:
        return "cancelled"
    except grpc.aio.AioRpcError as error:
        if error.code() is grpc.StatusCode.CANCELLED:
            return "cancelled"
        if error.code() is grpc.StatusCode.DEADLINE_EXCEEDED and kind == "timeout":
            return "timed out"
        if error.code() is grpc.StatusCode.UNAVAILABLE and "mid-transfer" in (error.details() or ""):
            return "transfer failed"
        raise


async def run_mix(stack: Stack, seed: int) -> dict[str, int]:
    rng = random.Random(seed)
    limit = asyncio.Semaphore(CONCURRENCY)
    outcomes: dict[str, int] = {}

    async def bounded(client: GatewayClient, index: int) -> None:
        async with limit:
            outcome = await one_request(client, index, rng.choice(KINDS), rng)
            outcomes[outcome] = outcomes.get(outcome, 0) + 1

    async with GatewayClient(stack.gateway_address) as client:
        await asyncio.wait_for(asyncio.gather(*(bounded(client, index) for index in range(NUM_REQUESTS))), 240)
    return outcomes


async def assert_every_pool_full(stack: Stack) -> None:
    full = [backend.load().num_total_blocks for backend in stack.decode]
    assert await wait_for_free_blocks(stack, full, timeout_s=15) == full
    for backend in stack.decode:
        load = backend.load()
        assert (load.num_running, load.num_waiting) == (0, 0), load
        assert backend.admissions.queue.num_waiting == 0
    for backend in stack.prefill:
        deadline = asyncio.get_running_loop().time() + 15
        while (load := backend.load()).num_free_blocks != load.num_total_blocks:
            assert asyncio.get_running_loop().time() < deadline, f"prefill pool not back to full: {load}"
            await asyncio.sleep(0.05)
    assert stack.router is not None
    deadline = asyncio.get_running_loop().time() + 15
    while stack.router._running:  # a handler whose client gave up ends a moment after
        assert asyncio.get_running_loop().time() < deadline, f"still running: {list(stack.router._running)}"
        await asyncio.sleep(0.05)
    assert [worker.in_flight for worker in stack.router.pool.of_role("decode", healthy_only=False)] == [0, 0]


@pytest.mark.timeout(400)
@pytest.mark.parametrize("mode", ["disaggregated", "colocated"])
async def test_mixed_endings_leave_every_pool_full(model_dir, mode, monkeypatch):
    stack = await start_stack(model_dir, mode, num_decode=2, health_interval_s=0.2)
    try:
        if mode == "disaggregated":
            break_some_transfers(monkeypatch, seed=7, probability=0.01)
        outcomes = await run_mix(stack, seed=11 if mode == "disaggregated" else 12)
        assert sum(outcomes.values()) == NUM_REQUESTS
        assert outcomes.get("finished", 0) > 0 and outcomes.get("cancelled", 0) > 0, outcomes
        await assert_every_pool_full(stack)
    finally:
        await stack.close()


async def test_a_cancelled_colocated_request_stops_within_a_step(model_dir):
    stack = await start_stack(model_dir, "colocated", num_decode=1, health_interval_s=0.2)
    try:
        assert stack.router is not None
        (decode,) = stack.decode
        steps_at_abort: dict[str, int] = {}
        real_abort_now = decode.admissions.abort_now

        def abort_now(request_id: str) -> bool:
            steps_at_abort[request_id] = decode.delivery.step
            return real_abort_now(request_id)

        decode.admissions.abort_now = abort_now
        async with GatewayClient(stack.gateway_address) as client:
            call = client.generate("A long story about a fox", max_tokens=200, temperature=0.0, ignore_eos=True,
                                   stream=IDS, request_id="long")
            async for response in call:
                if sum(len(sample.token_ids) for sample in response.samples) and "long" in stack.router._running:
                    (worker_request_id,) = stack.router._running["long"].parts
                    call.cancel()
                    break
        deadline = asyncio.get_running_loop().time() + 10
        while worker_request_id not in steps_at_abort or decode.admissions.held(worker_request_id) is not None:
            assert asyncio.get_running_loop().time() < deadline, "the request kept decoding"
            await asyncio.sleep(0.001)
        # the step running when the abort came, and the one that applies it, at most
        assert decode.delivery.step - steps_at_abort[worker_request_id] <= 2
        full = [decode.load().num_total_blocks]
        assert await wait_for_free_blocks(stack, full) == full
    finally:
        await stack.close()
