"""A request whose decode worker stops mid-stream continues on the other worker: the client's
stream equals an uninterrupted greedy run, token for token, and every KV block is freed.
With n > 1, each unfinished sample moves on its own and finished ones stay finished."""

from __future__ import annotations

from dataclasses import replace

import grpc
import openai
import pytest
import pytest_asyncio
import structlog

from cleave.client import GatewayClient
from cleave.client.gateway import Completion, collect
from cleave.generation.reasoning import Phase, ReasoningConfig
from cleave.generation.sampling_params import SamplingParams
from cleave.generation.seed_keys import row_key
from cleave.proto.cleave.v1 import common_pb2 as c, gateway_pb2 as g
from cleave.rpc.types import ReasoningOptions
from services.gateway.migration import continuation, thinking_budgets
from tests.services.gateway.helpers import reference_llm, wait_for_free_blocks
from tests.services.gateway.stack import MAX_MODEL_LEN, Stack, start_stack

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


def _num_tokens(responses: list[g.GenerateResponse]) -> int:
    return sum(len(s.token_ids) for r in responses for s in r.samples)


async def _read_until(stream, seen: list[g.GenerateResponse], enough) -> None:  # type: ignore[no-untyped-def]
    """Append the stream's responses to `seen` until `enough(seen)` holds."""
    if enough(seen):
        return
    async for response in stream:
        seen.append(response)
        if enough(seen):
            return


async def _responses_across_loss(  # type: ignore[no-untyped-def]
    stack: Stack, request_id: str, stream, lose=_stop_server, seen: list[g.GenerateResponse] | None = None
) -> tuple[list[g.GenerateResponse], str]:
    """Read the stream until STOP_AFTER_TOKENS tokens came, lose the request's decode worker
    (`lose(stack, address)`), then read the stream to the end."""
    seen = [] if seen is None else seen
    await _read_until(stream, seen, lambda responses: _num_tokens(responses) >= STOP_AFTER_TOKENS)
    assert stack.router is not None
    address = stack.router._running[request_id].decode.address
    await lose(stack, address)
    async for response in stream:
        seen.append(response)
    return seen, address


async def _replay(responses: list[g.GenerateResponse]):  # type: ignore[no-untyped-def]
    for response in responses:
        yield response


async def _stop_worker_mid_stream(  # type: ignore[no-untyped-def]
    stack: Stack, request_id: str, stream, lose=_stop_server
) -> tuple[Completion, str]:
    """`_responses_across_loss`, collected."""
    responses, address = await _responses_across_loss(stack, request_id, stream, lose)
    return await collect(_replay(responses)), address


def _migrations(logs: list[dict]) -> list[tuple[list[int], str, int]]:
    """(samples, lost worker, migration number) of each "request migrated" log line."""
    moved = [entry for entry in logs if entry["event"] == "request migrated"]
    return sorted((entry["samples"], entry["lost_worker"], entry["migration"]) for entry in moved)


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


@pytest.mark.parametrize("num_samples", [2, 3])
async def test_greedy_samples_each_continue_on_the_other_worker(two_workers, model_dir, num_samples):
    stack = two_workers
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, n=num_samples, logprobs=1)
    expected = reference_llm(model_dir).generate(PROMPT, params)[0]
    async with GatewayClient(stack.gateway_address) as client:
        with structlog.testing.capture_logs() as logs:
            stream = client.generate(PROMPT, max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, n=num_samples,
                                     logprobs=1, stream=IDS, request_id="samples")
            responses, stopped = await _responses_across_loss(stack, "samples", stream)
    result = await collect(_replay(responses))
    assert [sample.index for sample in result.samples] == list(range(num_samples))
    for sample, reference in zip(result.samples, expected.outputs, strict=True):
        assert sample.token_ids == reference.token_ids
        assert (sample.text, sample.reasoning_text) == (reference.text, reference.reasoning_text)
        assert sample.finish_reason == "length"
        logprobs = [entry for r in responses for s in r.samples if s.index == sample.index for entry in s.logprobs]
        assert [entry.sampled.token_id for entry in logprobs] == reference.token_ids
        assert [entry.sampled.logprob for entry in logprobs] == pytest.approx(
            [entry.logprob for entry in reference.logprobs], abs=1e-4
        )
    assert result.usage.completion_tokens == num_samples * MAX_TOKENS
    assert result.usage.reasoning_tokens == num_samples * MAX_TOKENS
    # One migration of the request; every sample restarted on its own.
    assert _migrations(logs) == [([index], stopped, 1) for index in range(num_samples)]
    full = [backend.load().num_total_blocks for backend in stack.decode]
    assert await wait_for_free_blocks(stack, full) == full
    assert [backend.load().num_running for backend in stack.decode] == [0, 0]


async def test_a_finished_sample_stays_finished_while_the_others_move(two_workers, model_dir):
    stack = two_workers
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, n=3)
    expected = reference_llm(model_dir).generate(PROMPT, params)[0]

    def sample_finished(index: int):  # type: ignore[no-untyped-def]
        return lambda seen: any(s.index == index and s.finish_reason for r in seen for s in r.samples)

    async with GatewayClient(stack.gateway_address) as client:
        with structlog.testing.capture_logs() as logs:
            stream = client.generate(PROMPT, max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, n=3,
                                     stream=IDS, request_id="partial")
            seen: list[g.GenerateResponse] = []
            await _read_until(stream, seen, lambda responses: _num_tokens(responses) >= STOP_AFTER_TOKENS)
            aborted = await client.stub.Abort(c.AbortRequest(request_id="partial", sample_index=1))
            assert aborted.found
            await _read_until(stream, seen, sample_finished(1))
            responses, stopped = await _responses_across_loss(stack, "partial", stream, seen=seen)
    result = await collect(_replay(responses))
    kept, cut, kept_too = result.samples
    assert cut.finish_reason == "abort"
    assert 0 < len(cut.token_ids) < MAX_TOKENS
    assert cut.token_ids == expected.outputs[1].token_ids[: len(cut.token_ids)]
    for sample in (kept, kept_too):
        assert sample.token_ids == expected.outputs[sample.index].token_ids
        assert sample.reasoning_text == expected.outputs[sample.index].reasoning_text
        assert sample.finish_reason == "length"
    assert result.usage.completion_tokens == 2 * MAX_TOKENS + len(cut.token_ids)
    assert _migrations(logs) == [([0], stopped, 1), ([2], stopped, 1)]  # the aborted sample stays put
    full = [backend.load().num_total_blocks for backend in stack.decode]
    assert await wait_for_free_blocks(stack, full) == full


async def test_n_samples_fail_unavailable_past_their_migration_budget(model_dir):
    stack = await start_stack(model_dir, "colocated", num_decode=3, max_migrations=1)
    try:
        async with GatewayClient(stack.gateway_address) as client:
            # Long enough that the stream cannot end before the second worker is stopped.
            stream = client.generate(PROMPT, max_tokens=MAX_MODEL_LEN // 2, temperature=0.0, ignore_eos=True, n=2,
                                     stream=IDS, request_id="budget")
            seen: list[g.GenerateResponse] = []
            await _read_until(stream, seen, lambda responses: _num_tokens(responses) >= STOP_AFTER_TOKENS)
            assert stack.router is not None
            first = stack.router._running["budget"].decode.address
            await _stop_server(stack, first)
            # Tokens already in flight from the lost worker may still arrive: read on until the
            # router has moved sample 0's part (checked at each response; the stream is long).
            def moved(_: list[g.GenerateResponse]) -> bool:
                running = stack.router._running.get("budget")
                found = running.part_of(0) if running is not None else None
                return found is not None and found[0].decode.address != first

            await _read_until(stream, seen, moved)
            second = stack.router._running["budget"].part_of(0)[0].decode.address
            with pytest.raises(grpc.aio.AioRpcError) as failure:
                await _responses_across_loss(stack, "budget", stream, lose=lambda s, _: _stop_server(s, second))
        assert failure.value.code() is grpc.StatusCode.UNAVAILABLE
        # lost while streaming, or while the moved part's Start was still in flight there (that
        # call then ends UNAVAILABLE or CANCELLED, as the server's shutdown reaches it)
        assert ("lost decode worker (internal address)" in failure.value.details()
                or "Start on decode worker (internal address) failed (" in failure.value.details())
        assert second not in failure.value.details() and "request id budget" in failure.value.details()
        assert "already moved 1 time(s) (max_migrations=1)" in failure.value.details()
        full = [backend.load().num_total_blocks for backend in stack.decode]
        assert await wait_for_free_blocks(stack, full) == full
    finally:
        await stack.close()


async def test_openai_stream_of_n_samples_continues_on_the_other_worker(two_workers, model_dir):
    stack = two_workers
    messages = [{"role": "user", "content": PROMPT}]
    (expected,) = reference_llm(model_dir).generate(
        messages, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, n=2)
    )
    api = stack.openai()
    stream = await api.chat.completions.create(
        model="tiny", messages=messages, max_tokens=MAX_TOKENS, temperature=0.0, n=2, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
    )
    reasoning, content, finish = ["", ""], ["", ""], [None, None]
    usage, num_chunks, stopped = None, 0, ""
    with structlog.testing.capture_logs() as logs:
        async for chunk in stream:
            num_chunks += 1
            usage = chunk.usage or usage
            for choice in chunk.choices:
                content[choice.index] += choice.delta.content or ""
                reasoning[choice.index] += getattr(choice.delta, "reasoning_content", None) or ""
                finish[choice.index] = choice.finish_reason or finish[choice.index]
            if num_chunks == 3:
                assert stack.router is not None
                (running,) = stack.router._running.values()
                stopped = running.decode.address
                await _stop_server(stack, stopped)
    assert _migrations(logs) == [([0], stopped, 1), ([1], stopped, 1)]
    assert reasoning == [output.reasoning_text for output in expected.outputs]
    assert content == [output.text for output in expected.outputs]
    assert finish == ["length", "length"]
    assert usage is not None and usage.completion_tokens == 2 * MAX_TOKENS
    full = [backend.load().num_total_blocks for backend in stack.decode]
    assert await wait_for_free_blocks(stack, full) == full


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


def test_moved_samples_continue_their_own_seeded_streams():
    params = SamplingParams(max_tokens=10, temperature=1.0, seed=7, n=3)
    moved = [
        continuation([1, 2], generated, params, ReasoningOptions(), phase=None, num_reasoning_tokens=0,
                     reasoning=None, max_model_len=64, sample_index=index)
        for index, generated in enumerate([[5], [5, 6], [5]])
    ]
    assert [m.sampling.seed for m in moved if m is not None] == [row_key(7, 0, 1), row_key(7, 1, 2), row_key(7, 2, 1)]
    assert len({m.sampling.seed for m in moved if m is not None}) == 3
    assert [(m.sampling.n, m.sampling.max_tokens) for m in moved if m is not None] == [(1, 9), (1, 8), (1, 9)]
    unseeded = continuation([1, 2], [5], replace(params, seed=None), ReasoningOptions(), phase=None,
                            num_reasoning_tokens=0, reasoning=None, max_model_len=64, sample_index=1)
    assert unseeded is not None and unseeded.sampling.seed is None


def test_thinking_budgets_by_phase():
    options = ReasoningOptions(max_thinking_tokens=8, min_thinking_tokens=3)
    assert thinking_budgets(options, Phase.ANSWER, 5, OPENS_THINKING) == ReasoningOptions()
    spent = thinking_budgets(options, Phase.REASONING, 10, OPENS_THINKING)
    assert (spent.max_thinking_tokens, spent.min_thinking_tokens) == (0, 0)
    assert thinking_budgets(options, Phase.BEFORE, 0, OPENS_THINKING) == options
    model_opens = ReasoningConfig(start_tag="<think>", end_tag="</think>", starts_in_reasoning=False)
    assert thinking_budgets(options, Phase.REASONING, 4, model_opens) == options
    assert thinking_budgets(options, None, 4, None) == options


async def test_a_decode_worker_the_prefill_worker_cannot_reach_is_moved_off(model_dir):
    """Disaggregated: the prefill worker's Admit on the placed decode worker fails UNAVAILABLE;
    the request moves to the other decode worker and streams the greedy tokens."""
    import grpc as grpc_module

    stack = await start_stack(model_dir, "disaggregated", num_decode=2, health_interval_s=0.2)
    try:
        victim, survivor = stack.router.pool.of_role("decode")
        survivor.in_flight += 10  # placement picks the victim first
        links = stack.prefill[0].decode_links
        real_stub = links.stub

        class Unreachable:
            async def Admit(self, request, timeout=None):  # type: ignore[no-untyped-def]
                raise grpc_module.aio.AioRpcError(grpc_module.StatusCode.UNAVAILABLE, grpc_module.aio.Metadata(),
                                                  grpc_module.aio.Metadata(), details="injected: connection refused")

        links.stub = lambda address: Unreachable() if address == victim.address else real_stub(address)
        expected = reference_llm(model_dir).generate(["Hello there"], SamplingParams(max_tokens=8, temperature=0.0))
        async with GatewayClient(stack.gateway_address) as client:
            result = await client.complete("Hello there", max_tokens=8, temperature=0.0,
                                           stream=g.StreamOptions(include_token_ids=True))
        assert result.samples[0].token_ids == expected[0].outputs[0].token_ids
        assert victim.healthy  # one failed admission does not take the worker out of rotation
        survivor.in_flight -= 10
    finally:
        await stack.close()
