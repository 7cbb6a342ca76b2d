"""A prefill worker that fails a request's Prefill (it died) does not fail the request: the
gateway retries once on another prefill worker, then has the decode worker prefill the
prompt itself. The client's tokens equal an undisturbed greedy run; every pool ends full."""

from __future__ import annotations

import asyncio

import structlog

from cleave.client import GatewayClient
from cleave.generation.sampling_params import SamplingParams
from cleave.proto.cleave.v1 import gateway_pb2 as g
from tests.services.gateway.helpers import assert_decode_pools_full, reference_llm
from tests.services.gateway.stack import Stack, start_stack

MAX_TOKENS = 24
IDS = g.StreamOptions(include_token_ids=True)
PROMPTS = [f"Retry {index}: a prompt for the prefill workers" for index in range(4)]


async def _stop(stack: Stack, address: str) -> None:
    """The prefill worker's server stops at once; the gateway has not noticed yet (its
    health checks are far apart), so it still routes there."""
    server = next(server for server in stack.servers if server.address == address)
    await server.drain(0)


async def _complete(stack: Stack, prompts: list[str]):  # type: ignore[no-untyped-def]
    async with GatewayClient(stack.gateway_address) as client:
        return await asyncio.gather(*(
            client.complete(prompt, max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, stream=IDS)
            for prompt in prompts))


def _expected(model_dir, prompts: list[str]) -> list[list[int]]:  # type: ignore[no-untyped-def]
    outputs = reference_llm(model_dir).generate(
        prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True))
    return [output.outputs[0].token_ids for output in outputs]


async def test_a_dead_prefill_worker_is_retried_on_the_other(model_dir):
    stack = await start_stack(model_dir, "disaggregated", num_prefill=2, health_interval_s=30.0)
    try:
        assert stack.router is not None
        dead, alive = stack.router.pool.of_role("prefill")
        await _stop(stack, dead.address)  # least loaded and first: the first request goes there
        with structlog.testing.capture_logs() as logs:
            results = await _complete(stack, PROMPTS)
        assert [result.samples[0].token_ids for result in results] == _expected(model_dir, PROMPTS)
        retried = [entry for entry in logs if entry["event"] == "prefill failed; retrying on another prefill worker"]
        assert retried and {entry["prefill"] for entry in retried} == {dead.address}
        assert not [entry for entry in logs if entry["event"] == "prefill failed; prefilling on the decode worker"]
        assert (dead.healthy, alive.healthy) == (False, True)
        await assert_decode_pools_full(stack)
        alive_backend = stack.prefill[1]
        load = alive_backend.load()
        assert load.num_free_blocks == load.num_total_blocks
    finally:
        await stack.close()


async def test_with_every_prefill_worker_dead_the_decode_worker_prefills(model_dir):
    stack = await start_stack(model_dir, "disaggregated", num_prefill=2, health_interval_s=30.0)
    try:
        assert stack.router is not None
        for worker in stack.router.pool.of_role("prefill"):
            await _stop(stack, worker.address)
        with structlog.testing.capture_logs() as logs:
            (result,) = await _complete(stack, PROMPTS[:1])
        assert result.samples[0].token_ids == _expected(model_dir, PROMPTS[:1])[0]
        assert result.samples[0].finish_reason == "length"
        events = [entry["event"] for entry in logs if entry["event"].startswith("prefill failed")]
        assert events == ["prefill failed; retrying on another prefill worker",
                          "prefill failed; prefilling on the decode worker"]
        await assert_decode_pools_full(stack)
    finally:
        await stack.close()
