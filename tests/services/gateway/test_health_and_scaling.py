"""Worker health rotation, no-worker errors and test-time scaling through the gateway."""

from __future__ import annotations

import asyncio

import grpc
import httpx
import pytest
import pytest_asyncio

from cleave.client import GatewayClient
from cleave.proto.cleave.v1 import common_pb2 as c, gateway_pb2 as g
from cleave.scaling import MathVerifier, extract_final_answer, group_advantages, normalize_answer, vote_summary
from tests.services.gateway.stack import start_stack

pytestmark = pytest.mark.asyncio(loop_scope="module")
PROMPT = "Numbers: one two three"


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def two_decoders(model_dir):
    running = await start_stack(model_dir, "colocated", num_decode=2, health_interval_s=0.1)
    yield running
    await running.close()


async def _wait_rotation(stack, expected: list[bool]) -> list[bool]:
    for _ in range(100):
        state = [w.healthy for w in stack.router.pool.of_role("decode", healthy_only=False)]
        if state == expected:
            break
        await asyncio.sleep(0.05)
    return state


async def test_unhealthy_worker_leaves_and_rejoins_rotation(two_decoders):
    stack = two_decoders
    decode_servers = stack.servers[1:3]  # kvstore, decode-0, decode-1, gateway
    await decode_servers[0].set_ready(False)
    assert await _wait_rotation(stack, [False, True]) == [False, True]
    async with GatewayClient(stack.gateway_address) as client:
        before = stack.decode[0].engine.scheduler.stats.num_prefill_tokens
        results = await asyncio.gather(*(client.complete(PROMPT, max_tokens=3) for _ in range(4)))
        assert all(len(r.samples) == 1 for r in results)
        assert stack.decode[0].engine.scheduler.stats.num_prefill_tokens == before  # nothing routed there
        await decode_servers[1].set_ready(False)
        assert await _wait_rotation(stack, [False, False]) == [False, False]
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            await client.complete(PROMPT, max_tokens=3)
        assert raised.value.code() == grpc.StatusCode.UNAVAILABLE
        async with httpx.AsyncClient() as http:
            response = await http.post(f"{stack.http_url}/completions", json={"prompt": "hi", "max_tokens": 2})
        assert response.status_code == 503
        for server in decode_servers:
            await server.set_ready(True)
        assert await _wait_rotation(stack, [True, True]) == [True, True]
        result = await client.complete(PROMPT, max_tokens=3)
    assert result.samples[0].finish_reason in ("length", "stop")


async def test_majority_vote_reports_votes_and_winner(two_decoders):
    scaling = g.TestTimeScaling(strategy=g.TestTimeScaling.STRATEGY_MAJORITY_VOTE, num_samples=6, return_all_samples=True)
    async with GatewayClient(two_decoders.gateway_address) as client:
        result = await client.complete(PROMPT, max_tokens=8, temperature=1.0, seed=11, scaling=scaling,
                                       reasoning=c.ReasoningOptions(max_thinking_tokens=2))
    assert len(result.samples) == 6
    answers = [normalize_answer(extract_final_answer(s.text)) for s in result.samples]
    assert [s.answer for s in result.samples] == answers
    expected = vote_summary(answers)
    assert [(v.answer, v.num_votes, list(v.sample_indices)) for v in result.votes] == [
        (v.answer, v.num_votes, v.sample_indices) for v in expected
    ]
    assert result.selected_index == (expected[0].sample_indices[0] if expected else None)


async def test_majority_vote_without_all_samples_returns_the_winner_only(two_decoders):
    scaling = g.TestTimeScaling(strategy=g.TestTimeScaling.STRATEGY_MAJORITY_VOTE, num_samples=4)
    async with GatewayClient(two_decoders.gateway_address) as client:
        result = await client.complete(PROMPT, max_tokens=6, temperature=1.0, seed=5, scaling=scaling,
                                       reasoning=c.ReasoningOptions(max_thinking_tokens=1))
    with_text = [s.index for s in result.samples if s.text or s.reasoning_text]
    assert with_text in ([], [result.selected_index])


async def test_group_rollout_rewards_and_advantages(two_decoders):
    verifier = g.Verifier(kind=g.Verifier.KIND_MATH, expected_answer="3")
    scaling = g.TestTimeScaling(strategy=g.TestTimeScaling.STRATEGY_GROUP_ROLLOUT, num_samples=5, verifier=verifier)
    async with GatewayClient(two_decoders.gateway_address) as client:
        result = await client.complete(PROMPT, max_tokens=8, temperature=1.0, seed=2, scaling=scaling,
                                       reasoning=c.ReasoningOptions(max_thinking_tokens=2))
    assert [s.index for s in result.samples] == list(range(5))
    with MathVerifier("3") as math:
        rewards = [math.score(s.text) for s in result.samples]
    assert [s.reward for s in result.samples] == rewards
    assert [s.advantage for s in result.samples] == pytest.approx(group_advantages(rewards))


async def test_verifiers_run_on_the_gateways_verification_threads(two_decoders, monkeypatch):
    """Not on asyncio's default executor, which other off-loop work shares: a sandboxed code
    verification may hold its thread for minutes."""
    import threading

    threads: list[str] = []
    score = MathVerifier.score

    def recording(self, text):  # type: ignore[no-untyped-def]
        threads.append(threading.current_thread().name)
        return score(self, text)

    monkeypatch.setattr(MathVerifier, "score", recording)
    verifier = g.Verifier(kind=g.Verifier.KIND_MATH, expected_answer="3")
    scaling = g.TestTimeScaling(strategy=g.TestTimeScaling.STRATEGY_GROUP_ROLLOUT, num_samples=3, verifier=verifier)
    async with GatewayClient(two_decoders.gateway_address) as client:
        await client.complete(PROMPT, max_tokens=4, temperature=1.0, seed=2, scaling=scaling)
    assert len(threads) == 3 and all(name.startswith("gateway-verify") for name in threads)


async def test_best_of_n_selects_the_highest_reward(two_decoders):
    verifier = g.Verifier(kind=g.Verifier.KIND_MATH, expected_answer="2")
    scaling = g.TestTimeScaling(strategy=g.TestTimeScaling.STRATEGY_BEST_OF_N, num_samples=4, verifier=verifier,
                                return_all_samples=True)
    async with GatewayClient(two_decoders.gateway_address) as client:
        result = await client.complete(PROMPT, max_tokens=8, temperature=1.0, seed=4, scaling=scaling,
                                       reasoning=c.ReasoningOptions(max_thinking_tokens=2))
    with MathVerifier("2") as math:
        rewards = [math.score(s.text) for s in result.samples]
    assert [s.reward for s in result.samples] == rewards
    assert result.selected_index == rewards.index(max(rewards))
    assert all(s.advantage is None for s in result.samples)
