"""A request whose decode worker stops mid-stream continues on the other worker: the client's
stream equals an uninterrupted greedy run, token for token, and every KV block is freed."""

from __future__ import annotations

import grpc
import pytest
import pytest_asyncio
import structlog

from cleave.client import GatewayClient
from cleave.client.gateway import Completion, collect
from cleave.engine.reasoning import Phase
from cleave.engine.request import ReasoningConfig
from cleave.engine.sampling_params import SamplingParams
from cleave.proto.cleave.v1 import common_pb2 as c, gateway_pb2 as g
from cleave.rpc.types import ReasoningOptions
from services.gateway.migration import continuation, thinking_budgets
from tests.services.gateway.helpers import reference_llm, wait_for_free_blocks
from tests.services.gateway.stack import Stack, start_stack

PROMPT = "The quick brown fox"
MAX_TOKENS = 48
STOP_AFTER_TOKENS = 4
IDS = g.StreamOptions(include_token_ids=True)
OPENS_THINKING = ReasoningConfig(start_tag="<think>", end_tag="</think>", starts_in_reasoning=True)


@pytest_asyncio.fixture(loop_scope="function", params=["colocated", "disaggregated"])
async def two_workers(request, model_dir):
    """A fresh stack with two decode workers (one of them gets stopped)."""
    stack = await start_stack(model_dir, request.param, num_decode=2, health_interval_s=0.2)
    yield stack
    await stack.close()


async def _stop_server(stack: Stack, address: str) -> None:
    """The worker's server stops at once (in-flight calls cancelled, no grace)."""
    server = next(server for server in stack.servers if server.address == address)
    await server.drain(0)


async def _stop_worker_mid_stream(  # type: ignore[no-untyped-def]
    stack: Stack, request_id: str, stream, lose=_stop_server
) -> tuple[Completion, str]:
    """Read the stream until STOP_AFTER_TOKENS tokens came, lose the request's decode worker
    (`lose(stack, address)`), then read the stream to the end."""
    seen: list[g.GenerateResponse] = []
    async for response in stream:
        seen.append(response)
        if sum(len(s.token_ids) for r in seen for s in r.samples) >= STOP_AFTER_TOKENS:
            break
    assert stack.router is not None
    address = stack.router._running[request_id].decode.address
    await lose(stack, address)

    async def rest():  # type: ignore[no-untyped-def]
        for response in seen:
            yield response
        async for response in stream:
            yield response

    return await collect(rest()), address


async def test_greedy_stream_continues_on_the_other_worker(two_workers, model_dir):
    stack = two_workers
    expected = reference_llm(model_dir).generate(
        PROMPT, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    )[0]
    async with GatewayClient(stack.gateway_address) as client:
        with structlog.testing.capture_logs() as logs:
            stream = client.generate(PROMPT, max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True,
                                     stream=IDS, request_id="moving")
            result, stopped = await _stop_worker_mid_stream(stack, "moving", stream)
    (sample,) = result.samples
    assert sample.token_ids == expected.outputs[0].token_ids
    assert (sample.text, sample.reasoning_text) == (expected.outputs[0].text, expected.outputs[0].reasoning_text)
    assert sample.finish_reason == "length"
    assert result.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert result.usage.completion_tokens == MAX_TOKENS
    assert result.usage.reasoning_tokens == MAX_TOKENS  # no </think>: the whole output is thinking
    (moved,) = [entry for entry in logs if entry["event"] == "request migrated"]
    assert (moved["request_id"], moved["lost_worker"], moved["migration"]) == ("moving", stopped, 1)
    assert STOP_AFTER_TOKENS <= moved["num_generated"] < MAX_TOKENS
    full = [backend.load().num_total_blocks for backend in stack.decode]
    assert await wait_for_free_blocks(stack, full) == full


async def test_unanswered_health_checks_move_the_stream_and_free_the_old_worker(two_workers, model_dir):
    async def unreachable(stack: Stack, address: str) -> None:  # alive, but its checks time out
        assert stack.router is not None
        (worker,) = [w for w in stack.router.pool.workers if w.address == address]
        worker.failed_checks = stack.router.pool.options.lost_after_failed_checks
        await stack.router._on_worker_lost(worker)

    stack = two_workers
    expected = reference_llm(model_dir).generate(
        PROMPT, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    )[0]
    async with GatewayClient(stack.gateway_address) as client:
        stream = client.generate(PROMPT, max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True,
                                 stream=IDS, request_id="unreachable")
        result, _ = await _stop_worker_mid_stream(stack, "unreachable", stream, lose=unreachable)
    assert result.samples[0].token_ids == expected.outputs[0].token_ids
    full = [backend.load().num_total_blocks for backend in stack.decode]
    assert await wait_for_free_blocks(stack, full) == full
    assert [backend.load().num_running for backend in stack.decode] == [0, 0]


async def test_thinking_budget_counts_the_tokens_before_the_move(two_workers, model_dir):
    stack = two_workers
    budget = 12
    reference = reference_llm(model_dir)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, max_thinking_tokens=budget)
    expected = reference.generate(PROMPT, params)[0].outputs[0]
    end_tag = reference.tokenizer.encode("</think>", add_special_tokens=False)
    assert expected.token_ids[budget:budget + len(end_tag)] == end_tag
    async with GatewayClient(stack.gateway_address) as client:
        stream = client.generate(PROMPT, max_tokens=24, temperature=0.0, ignore_eos=True, stream=IDS,
                                 request_id="thinking", reasoning=c.ReasoningOptions(max_thinking_tokens=budget))
        result, _ = await _stop_worker_mid_stream(stack, "thinking", stream)
    (sample,) = result.samples
    assert sample.token_ids == expected.token_ids
    assert (sample.text, sample.reasoning_text) == (expected.text, expected.reasoning_text)


async def test_n_samples_fail_unavailable_when_their_worker_stops(two_workers):
    async with GatewayClient(two_workers.gateway_address) as client:
        stream = client.generate(PROMPT, max_tokens=MAX_TOKENS, temperature=1.0, seed=3, n=2, ignore_eos=True,
                                 stream=IDS, request_id="pair")
        with pytest.raises(grpc.aio.AioRpcError) as failure:
            await _stop_worker_mid_stream(two_workers, "pair", stream)
    assert failure.value.code() is grpc.StatusCode.UNAVAILABLE
    assert "n > 1" in failure.value.details()


async def test_no_worker_left_fails_unavailable(model_dir):
    stack = await start_stack(model_dir, "colocated", num_decode=1)
    try:
        async with GatewayClient(stack.gateway_address) as client:
            stream = client.generate(PROMPT, max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True,
                                     stream=IDS, request_id="stranded")
            with pytest.raises(grpc.aio.AioRpcError) as failure:
                await _stop_worker_mid_stream(stack, "stranded", stream)
        assert failure.value.code() is grpc.StatusCode.UNAVAILABLE
    finally:
        await stack.close()


def test_continuation_prompt_and_limits():
    params = SamplingParams(max_tokens=10, temperature=0.0, max_thinking_tokens=8, min_thinking_tokens=3)
    options = ReasoningOptions(max_thinking_tokens=8, min_thinking_tokens=3)
    resumed = continuation([1, 2, 3], [7, 8], params, options, phase=Phase.REASONING, num_reasoning_tokens=2,
                           reasoning=OPENS_THINKING, max_model_len=64)
    assert resumed is not None
    assert resumed.prompt_token_ids == [1, 2, 3, 7, 8]
    assert (resumed.sampling.max_tokens, resumed.sampling.max_thinking_tokens, resumed.sampling.min_thinking_tokens) == (8, 6, 1)
    assert (resumed.reasoning.max_thinking_tokens, resumed.reasoning.min_thinking_tokens) == (6, 1)
    assert params.max_tokens == 10  # the request's own params are untouched
    unlimited = continuation([1, 2, 3], [7, 8], SamplingParams(max_tokens=None), ReasoningOptions(), phase=None,
                             num_reasoning_tokens=0, reasoning=None, max_model_len=64)
    assert unlimited is not None and unlimited.sampling.max_tokens is None
    assert continuation([1, 2, 3], list(range(10)), params, options, phase=Phase.ANSWER, num_reasoning_tokens=5,
                        reasoning=OPENS_THINKING, max_model_len=64) is None
    assert continuation([1, 2, 3], list(range(61)), SamplingParams(max_tokens=None), options, phase=None,
                        num_reasoning_tokens=0, reasoning=None, max_model_len=64) is None


def test_thinking_budgets_by_phase():
    options = ReasoningOptions(max_thinking_tokens=8, min_thinking_tokens=3)
    assert thinking_budgets(options, Phase.ANSWER, 5, OPENS_THINKING) == ReasoningOptions()
    spent = thinking_budgets(options, Phase.REASONING, 10, OPENS_THINKING)
    assert (spent.max_thinking_tokens, spent.min_thinking_tokens) == (0, 0)
    assert thinking_budgets(options, Phase.BEFORE, 0, OPENS_THINKING) == options
    model_opens = ReasoningConfig(start_tag="<think>", end_tag="</think>", starts_in_reasoning=False)
    assert thinking_budgets(options, Phase.REASONING, 4, model_opens) == options
    assert thinking_budgets(options, None, 4, None) == options
