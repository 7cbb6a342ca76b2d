"""Test-time scaling on the gateway: combine a request's finished samples with `cleave.scaling`.

All samples come from one n-sample engine request (they share the prompt's KV on the decode
worker). Once every sample has finished, `run_scaling` extracts and votes on the answers,
scores them with the requested verifier (on the gateway's verification threads, so a slow
sandbox never holds the threads other work shares) and computes GRPO advantages;
`summary_chunk` turns its `ScalingResult` into the stream's final message.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Executor

from cleave.scaling import CodeVerifier, MathVerifier, ScalingRequest, ScalingResult, Strategy, run_scaling
from cleave.scaling.code_verifier import MAX_CANDIDATE_TIMEOUT_S
from cleave.scaling.sandbox import SandboxLimits
from services.gateway.backend import GenerateChunk, SampleOutput, Scaling, VerifierKind, VerifierSpec

DEFAULT_MATH_TIMEOUT_S = 2.0


def build_verifier(verifier: VerifierSpec | None) -> MathVerifier | CodeVerifier | None:
    """The cleave.scaling verifier for a request's Verifier spec."""
    if verifier is None:
        return None
    if verifier.kind is VerifierKind.MATH:
        return MathVerifier(verifier.expected_answer, timeout_s=verifier.timeout_s or DEFAULT_MATH_TIMEOUT_S)
    limits = SandboxLimits() if verifier.timeout_s is None else SandboxLimits(wall_timeout_s=verifier.timeout_s)
    return CodeVerifier(verifier.tests, limits, total_timeout_s=MAX_CANDIDATE_TIMEOUT_S)


async def combine(
    request_id: str, scaling: Scaling, texts: Sequence[str], executor: Executor | None = None
) -> ScalingResult:
    """Score and combine finished samples (`texts[i]` is sample i's answer text), the
    verifier on `executor`'s threads."""
    verifier = build_verifier(scaling.verifier)
    try:
        return await run_scaling(
            lambda n: list(texts),
            ScalingRequest(request_id=request_id),
            scaling.strategy,
            len(texts),
            verifier,
            executor,
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
    votes = tuple(result.votes)
    return GenerateChunk(
        samples=samples,
        selected_index=result.selected_index,
        votes=votes if result.strategy is Strategy.MAJORITY_VOTE else (),
    )
