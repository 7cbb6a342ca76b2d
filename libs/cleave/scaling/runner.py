"""Run one test-time-scaling request: gather samples, extract answers, score, combine.

The caller supplies the samples through `generate_fn(n)`, typically one engine request with
`SamplingParams(n=n)` whose samples share the prompt's KV. It may return a list, an awaitable
of a list, or an async iterator that yields samples as they finish; with an iterator each
sample is verified while the others are still generating. Verifiers are synchronous
(`score(text) -> float`, possibly slow: code runs in a sandbox) and run in worker threads
(the caller's `executor`, or asyncio's default one), at most
`ScalingRequest.max_concurrent_verifications` at a time.
"""

from __future__ import annotations

import asyncio
import contextvars
import inspect
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from concurrent.futures import Executor
from dataclasses import dataclass, replace
from typing import Any, Protocol, Union

from cleave.errors import InvalidArgument
from cleave.scaling.answers import extract_final_answer, normalize_answer
from cleave.scaling.strategies import (
    AnswerVotes,
    CandidateScore,
    ScalingResult,
    Strategy,
    best_of_n,
    group_advantages,
    vote_summary,
)


class Verifier(Protocol):
    """Anything that scores a completion's full text with a reward (MathVerifier, CodeVerifier)."""

    def score(self, text: str) -> float: ...


@dataclass(frozen=True)
class Candidate:
    """One generated sample. `index` defaults to arrival order; `mean_logprob` is per token."""

    text: str
    index: int | None = None
    num_tokens: int | None = None
    mean_logprob: float | None = None


@dataclass(frozen=True)
class ScalingRequest:
    """Per-request settings of the runner.

    Attributes:
        request_id: carried for logs and errors.
        answer_extractor: raw final answer of a completion (normalized afterwards).
        max_concurrent_verifications: verifier calls running at once.
    """

    request_id: str = ""
    answer_extractor: Callable[[str], str | None] = extract_final_answer
    max_concurrent_verifications: int = 4


SampleLike = Union[str, Candidate, Any]
GenerateResult = Union[Iterable[SampleLike], Awaitable[Iterable[SampleLike]], AsyncIterator[SampleLike]]


def as_candidate(sample: SampleLike, arrival_index: int) -> Candidate:
    """A Candidate from a string, a Candidate, or an engine CompletionOutput-like object."""
    if isinstance(sample, str):
        return Candidate(sample, arrival_index)
    if isinstance(sample, Candidate):
        return sample if sample.index is not None else replace(sample, index=arrival_index)
    text = sample.text
    index = getattr(sample, "index", arrival_index)
    num_tokens = getattr(sample, "num_tokens", None) or None
    cumulative = getattr(sample, "cumulative_logprob", None)
    mean_logprob = cumulative / num_tokens if cumulative is not None and num_tokens else None
    return Candidate(text, index, num_tokens, mean_logprob)


async def _score(
    verifier: Verifier, text: str, limiter: asyncio.Semaphore, executor: Executor | None
) -> tuple[float, str | None]:
    async with limiter:
        try:
            call = contextvars.copy_context().run  # the caller's log context goes with the call
            return float(await asyncio.get_running_loop().run_in_executor(executor, call, verifier.score, text)), None
        except Exception as error:  # a verifier failure costs the sample its reward, not the request
            return 0.0, f"{type(error).__name__}: {error}"


async def _collect(
    generated: GenerateResult, verifier: Verifier | None, limiter: asyncio.Semaphore, executor: Executor | None
) -> list[tuple[Candidate, asyncio.Task | None]]:
    if inspect.isawaitable(generated):
        generated = await generated

    def start(sample: SampleLike, arrival_index: int) -> tuple[Candidate, asyncio.Task | None]:
        candidate = as_candidate(sample, arrival_index)
        task = asyncio.ensure_future(_score(verifier, candidate.text, limiter, executor)) if verifier else None
        return candidate, task

    collected: list[tuple[Candidate, asyncio.Task | None]] = []
    try:
        if hasattr(generated, "__aiter__"):
            async for sample in generated:
                collected.append(start(sample, len(collected)))
        else:
            for sample in generated:
                collected.append(start(sample, len(collected)))
    except BaseException:
        for _, task in collected:
            if task is not None:
                task.cancel()
        raise
    return collected


def _validate(strategy: Strategy, num_samples: int, verifier: Verifier | None) -> None:
    if num_samples < 1:
        raise InvalidArgument(f"num_samples must be at least 1, got {num_samples}", field="num_samples")
    if strategy is Strategy.GROUP_ROLLOUT and verifier is None:
        raise InvalidArgument("GROUP_ROLLOUT needs a verifier to compute rewards", field="verifier")


async def run_scaling(
    generate_fn: Callable[[int], GenerateResult],
    request: ScalingRequest,
    strategy: Strategy,
    num_samples: int,
    verifier: Verifier | None = None,
    executor: Executor | None = None,
) -> ScalingResult:
    """Draw `num_samples` samples and combine them with `strategy`; the verifier runs on
    `executor`'s threads (None: asyncio's default executor).

    BEST_OF_N ranks by verifier reward; without a verifier it ranks by mean token logprob
    when every sample carries one (a verifier-free heuristic), and otherwise is refused.
    Raises InvalidArgument for a bad request; a sample whose verifier fails gets reward 0.
    """
    strategy = Strategy(strategy)
    _validate(strategy, num_samples, verifier)
    limiter = asyncio.Semaphore(max(1, request.max_concurrent_verifications))
    collected = await _collect(generate_fn(num_samples), verifier, limiter, executor)
    if not collected:
        raise InvalidArgument(f"request {request.request_id!r}: generation returned no samples")
    collected.sort(key=lambda item: item[0].index)
    scores = [await task if task is not None else (None, None) for _, task in collected]
    candidates = [candidate for candidate, _ in collected]
    answers = [normalize_answer(request.answer_extractor(candidate.text)) for candidate in candidates]
    rewards = [reward for reward, _ in scores]

    ranking: list[float] | None = rewards if verifier is not None else None
    if strategy is Strategy.BEST_OF_N and ranking is None:
        logprobs = [candidate.mean_logprob for candidate in candidates]
        if any(logprob is None for logprob in logprobs):
            raise InvalidArgument("BEST_OF_N needs a verifier (or samples with logprobs)", field="verifier")
        ranking = logprobs
    advantages = group_advantages(rewards) if verifier is not None else [None] * len(candidates)

    scored = [
        CandidateScore(
            index=candidate.index,
            text=candidate.text,
            answer=answer,
            reward=reward,
            advantage=advantage,
            num_tokens=candidate.num_tokens,
            mean_logprob=candidate.mean_logprob,
            error=error,
        )
        for candidate, answer, reward, advantage, (_, error) in zip(candidates, answers, rewards, advantages, scores)
    ]
    votes_by_position = vote_summary(answers)
    selected: int | None = None  # a position in `scored`
    if strategy is Strategy.MAJORITY_VOTE and votes_by_position:
        selected = votes_by_position[0].sample_indices[0]
    elif strategy is Strategy.BEST_OF_N:
        selected = best_of_n(scored, ranking)
    selected_candidate = scored[selected] if selected is not None else None
    votes = [
        AnswerVotes(votes.answer, votes.num_votes, [scored[position].index for position in votes.sample_indices])
        for votes in votes_by_position
    ]
    return ScalingResult(
        strategy=strategy,
        selected_index=selected_candidate.index if selected_candidate else None,
        answer=selected_candidate.answer if selected_candidate else None,
        votes=votes,
        candidates=scored,
    )
