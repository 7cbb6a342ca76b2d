import asyncio

import pytest

from cleave.errors import InvalidArgument
from cleave.scaling.math_verifier import MathVerifier
from cleave.scaling.runner import Candidate, ScalingRequest, run_scaling
from cleave.scaling.strategies import AnswerVotes, Strategy

TEXTS = [
    "<think>a</think> The answer is 12.",
    "<think>b</think> The answer is 13.",
    "<think>c</think> The answer is 13.",
    "<think>d",  # cut off while thinking: no answer
    "<think>e</think> The answer is 12.0.",
    "<think>f</think> The answer is 12.",
]


def generate_list(n):
    assert n == len(TEXTS)
    return list(TEXTS)


async def test_majority_vote_normalizes_answers_and_picks_the_first_voter():
    result = await run_scaling(generate_list, ScalingRequest(), Strategy.MAJORITY_VOTE, 6, None)
    assert result.answer == "12" and result.selected_index == 0
    assert result.votes == [AnswerVotes("12", 3, [0, 4, 5]), AnswerVotes("13", 2, [1, 2])]
    assert [c.answer for c in result.candidates] == ["12", "13", "13", None, "12", "12"]
    assert result.rewards == [None] * 6


async def test_best_of_n_and_group_rollout_with_a_verifier():
    verifier = MathVerifier("13", use_sympy=False)
    best = await run_scaling(generate_list, ScalingRequest(), Strategy.BEST_OF_N, 6, verifier)
    assert (best.selected_index, best.answer) == (1, "13")
    assert best.rewards == [0.0, 1.0, 1.0, 0.0, 0.0, 0.0]
    rollout = await run_scaling(generate_list, ScalingRequest(), "group_rollout", 6, verifier)
    assert rollout.selected_index is None and rollout.answer is None
    advantages = [c.advantage for c in rollout.candidates]
    assert advantages == pytest.approx([-0.7071, 1.4142, 1.4142, -0.7071, -0.7071, -0.7071], abs=1e-3)


async def test_async_iterator_out_of_order_and_verification_overlaps_generation():
    scored_while_generating = []

    class SlowVerifier:
        def score(self, text):
            scored_while_generating.append(text)
            return float("13" in text)

    async def generate(n):
        for index in reversed(range(n)):
            yield Candidate(TEXTS[index], index=index, num_tokens=10 + index, mean_logprob=-0.1 * index)
            await asyncio.sleep(0.01)
        assert len(scored_while_generating) >= 1

    result = await run_scaling(generate, ScalingRequest(max_concurrent_verifications=2), Strategy.BEST_OF_N, 6, SlowVerifier())
    assert [c.index for c in result.candidates] == [0, 1, 2, 3, 4, 5]
    assert result.selected_index == 1
    assert result.candidates[5].num_tokens == 15


async def test_best_of_n_without_verifier_ranks_by_mean_logprob():
    async def generate(n):
        return [Candidate(text, mean_logprob=logprob) for text, logprob in zip(TEXTS, [-0.5, -0.2, -0.9, -0.1, -0.3, -0.4])]

    result = await run_scaling(generate, ScalingRequest(), Strategy.BEST_OF_N, 6)
    assert result.selected_index == 3 and result.answer is None


async def test_completion_like_objects_and_verifier_errors():
    class Output:
        def __init__(self, index, text):
            self.index, self.text, self.num_tokens, self.cumulative_logprob = index, text, 4, -2.0

    class BrokenVerifier:
        def score(self, text):
            raise RuntimeError("sandbox unavailable")

    result = await run_scaling(
        lambda n: [Output(1, TEXTS[1]), Output(0, TEXTS[0])], ScalingRequest(), Strategy.NONE, 2, BrokenVerifier()
    )
    assert [c.index for c in result.candidates] == [0, 1]
    assert result.candidates[0].mean_logprob == -0.5
    assert result.rewards == [0.0, 0.0] and result.candidates[0].error == "RuntimeError: sandbox unavailable"
    assert result.selected_index is None


async def test_bad_requests_are_refused():
    with pytest.raises(InvalidArgument):
        await run_scaling(generate_list, ScalingRequest(), Strategy.GROUP_ROLLOUT, 6, None)
    with pytest.raises(InvalidArgument):
        await run_scaling(generate_list, ScalingRequest(), Strategy.BEST_OF_N, 6, None)
    with pytest.raises(InvalidArgument):
        await run_scaling(generate_list, ScalingRequest(), Strategy.MAJORITY_VOTE, 0, None)
    with pytest.raises(InvalidArgument):
        await run_scaling(lambda n: [], ScalingRequest(), Strategy.MAJORITY_VOTE, 3, None)


async def test_generation_failure_propagates():
    started = []

    class Verifier:
        def score(self, text):
            started.append(text)
            return 1.0

    async def generate(n):
        yield "The answer is 1."
        raise RuntimeError("decode worker lost")

    with pytest.raises(RuntimeError, match="decode worker lost"):
        await run_scaling(generate, ScalingRequest(), Strategy.MAJORITY_VOTE, 2, Verifier())


async def test_the_verifier_runs_on_the_callers_executor_with_its_log_context():
    """A gateway's verifications take threads of their own (`executor`), not the default
    executor other off-loop work shares, and keep the request's structlog context."""
    from concurrent.futures import ThreadPoolExecutor

    import structlog

    seen = []

    class Recording:
        def score(self, text):
            seen.append((__import__("threading").current_thread().name,
                         structlog.contextvars.get_contextvars().get("request_id")))
            return 1.0

    structlog.contextvars.bind_contextvars(request_id="r-7")
    try:
        with ThreadPoolExecutor(2, thread_name_prefix="verify") as pool:
            result = await run_scaling(generate_list, ScalingRequest(), Strategy.BEST_OF_N, 6, Recording(), pool)
    finally:
        structlog.contextvars.unbind_contextvars("request_id")
    assert result.rewards == [1.0] * 6
    assert len(seen) == 6 and all(name.startswith("verify") and rid == "r-7" for name, rid in seen)
