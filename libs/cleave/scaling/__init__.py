"""Test-time scaling: answer extraction, verifiers, and combining a prompt's samples.

`run_scaling` (runner) gathers samples, extracts and normalizes answers (answers), scores
them with a verifier (math_verifier, code_verifier over sandbox) and combines them with a
`Strategy` (strategies) into a `ScalingResult`.
"""

from cleave.scaling.answers import extract_code, extract_final_answer, normalize_answer, parse_number
from cleave.scaling.code_verifier import CodeTest, CodeVerification, CodeVerifier, FailureReason, TestOutcome
from cleave.scaling.math_verifier import MathVerifier
from cleave.scaling.runner import Candidate, ScalingRequest, Verifier, run_scaling
from cleave.scaling.sandbox import SandboxLimits, SandboxRun, run_sandboxed
from cleave.scaling.strategies import (
    AnswerVotes,
    CandidateScore,
    ScalingResult,
    Strategy,
    best_of_n,
    group_advantages,
    majority_vote,
    vote_summary,
)

__all__ = [
    "AnswerVotes",
    "Candidate",
    "CandidateScore",
    "CodeTest",
    "CodeVerification",
    "CodeVerifier",
    "FailureReason",
    "MathVerifier",
    "SandboxLimits",
    "SandboxRun",
    "ScalingRequest",
    "ScalingResult",
    "Strategy",
    "TestOutcome",
    "Verifier",
    "best_of_n",
    "extract_code",
    "extract_final_answer",
    "group_advantages",
    "majority_vote",
    "normalize_answer",
    "parse_number",
    "run_sandboxed",
    "run_scaling",
    "vote_summary",
]
