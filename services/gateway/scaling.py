"""Test-time scaling on the gateway: combine a request's finished samples with `cleave.scaling`.

All samples come from one n-sample engine request (they share the prompt's KV on the decode
worker). Once every sample has finished, `run_scaling` extracts and votes on the answers,
scores them with the requested verifier (in worker threads) and computes GRPO advantages;
`summary_chunk` turns its `ScalingResult` into the stream's final message.
"""

from __future__ import annotations

from collections.abc import Sequence

from cleave.scaling import CodeTest as ScalingCodeTest
from cleave.scaling import CodeVerifier, MathVerifier, ScalingRequest, ScalingResult, Strategy, run_scaling
from cleave.scaling.sandbox import SandboxLimits
from services.gateway.backend import (
    AnswerVotes,
    GenerateChunk,
    SampleOutput,
    Scaling,
    ScalingStrategy,
    Verifier,
    VerifierKind,
)

_STRATEGIES = {
    ScalingStrategy.NONE: Strategy.NONE,
    ScalingStrategy.MAJORITY_VOTE: Strategy.MAJORITY_VOTE,
    ScalingStrategy.BEST_OF_N: Strategy.BEST_OF_N,
    ScalingStrategy.GROUP_ROLLOUT: Strategy.GROUP_ROLLOUT,
}
DEFAULT_MATH_TIMEOUT_S = 2.0


def build_verifier(verifier: Verifier | None) -> MathVerifier | CodeVerifier | None:
    """The cleave.scaling verifier for a request's Verifier spec."""
    if verifier is None:
        return None
    if verifier.kind is VerifierKind.MATH:
        return MathVerifier(verifier.expected_answer, timeout_s=verifier.timeout_s or DEFAULT_MATH_TIMEOUT_S)
    limits = SandboxLimits() if verifier.timeout_s is None else SandboxLimits(wall_timeout_s=verifier.timeout_s)
    tests = [ScalingCodeTest(stdin=t.stdin, expected_stdout=t.expected_stdout) for t in verifier.tests]
    return CodeVerifier(tests, limits)


async def combine(request_id: str, scaling: Scaling, texts: Sequence[str]) -> ScalingResult:
    """Score and combine finished samples (`texts[i]` is sample i's answer text)."""
    verifier = build_verifier(scaling.verifier)
    try:
        return await run_scaling(
            lambda n: list(texts),
            ScalingRequest(request_id=request_id),
            _STRATEGIES[scaling.strategy],
            len(texts),
            verifier,
        )
    finally:
        if isinstance(verifier, MathVerifier):
            verifier.close()


def summary_chunk(result: ScalingResult) -> GenerateChunk:
    """The final message: per-sample answer/reward/advantage, the selection and the votes."""
    samples = tuple(
        SampleOutput(
            index=candidate.index,
            answer=candidate.answer,
            reward=candidate.reward,
            advantage=candidate.advantage if result.strategy is Strategy.GROUP_ROLLOUT else None,
        )
        for candidate in result.candidates
    )
    votes = tuple(AnswerVotes(v.answer, v.num_votes, tuple(v.sample_indices)) for v in result.votes)
    return GenerateChunk(
        samples=samples,
        selected_index=result.selected_index,
        votes=votes if result.strategy is Strategy.MAJORITY_VOTE else (),
    )
