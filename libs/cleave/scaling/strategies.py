"""Pure combination rules over a group of samples of one prompt, and the result they make.

`majority_vote` counts normalized answers (self-consistency), `best_of_n` picks the highest
reward, `group_advantages` turns a group's rewards into GRPO advantages. Ties always go to
the earliest sample, so the same samples give the same result.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

ADVANTAGE_EPSILON = 1e-6


class Strategy(str, enum.Enum):
    """How a group of samples is combined (mirrors gateway.proto TestTimeScaling.Strategy)."""

    NONE = "none"
    MAJORITY_VOTE = "majority_vote"
    BEST_OF_N = "best_of_n"
    GROUP_ROLLOUT = "group_rollout"


@dataclass(frozen=True)
class AnswerVotes:
    """Votes for one distinct answer: how many samples gave it and which."""

    answer: str
    num_votes: int
    sample_indices: list[int]


@dataclass(frozen=True)
class CandidateScore:
    """One sample as scored: its extracted answer, reward and group-relative advantage."""

    index: int
    text: str
    answer: str | None
    reward: float | None = None
    advantage: float | None = None
    num_tokens: int | None = None
    mean_logprob: float | None = None
    error: str | None = None


@dataclass(frozen=True)
class ScalingResult:
    """The outcome of test-time scaling over one prompt's samples.

    Attributes:
        strategy: how the samples were combined.
        selected_index: the winning sample (MAJORITY_VOTE, BEST_OF_N), else None.
        answer: the winning normalized answer, else None.
        votes: distinct answers, most votes first (ties: earliest first occurrence).
        candidates: every sample in index order.
    """

    strategy: Strategy
    selected_index: int | None
    answer: str | None
    votes: list[AnswerVotes] = field(default_factory=list)
    candidates: list[CandidateScore] = field(default_factory=list)

    @property
    def rewards(self) -> list[float | None]:
        """Per-sample rewards in index order."""
        return [candidate.reward for candidate in self.candidates]


def vote_summary(answers: Sequence[str | None]) -> list[AnswerVotes]:
    """Distinct answers with their voters, most votes first, ties by first occurrence."""
    voters: dict[str, list[int]] = {}
    for index, answer in enumerate(answers):
        if answer is not None:
            voters.setdefault(answer, []).append(index)
    ranked = sorted(voters.items(), key=lambda item: (-len(item[1]), item[1][0]))
    return [AnswerVotes(answer, len(indices), indices) for answer, indices in ranked]


def majority_vote(answers: Sequence[str | None]) -> tuple[str | None, dict[str, int]]:
    """The most frequent answer (None answers abstain) and the vote counts, most first.

    Ties go to the answer that appeared first; no answers at all gives (None, {}).
    """
    summary = vote_summary(answers)
    counts = {votes.answer: votes.num_votes for votes in summary}
    return (summary[0].answer if summary else None), counts


def best_of_n(candidates: Sequence[object], rewards: Sequence[float]) -> int:
    """Index of the highest reward (the earliest on ties); NaN rewards never win."""
    if len(candidates) != len(rewards):
        raise ValueError(f"{len(candidates)} candidates but {len(rewards)} rewards")
    if not rewards:
        raise ValueError("best_of_n needs at least one candidate")
    best_index = 0
    best_reward = -math.inf
    for index, reward in enumerate(rewards):
        if not math.isnan(reward) and reward > best_reward:
            best_index, best_reward = index, reward
    return best_index


def group_advantages(rewards: Sequence[float], epsilon: float = ADVANTAGE_EPSILON) -> list[float]:
    """GRPO advantages: (reward - mean) / (population std + epsilon); equal rewards give zeros."""
    if not rewards:
        return []
    mean = sum(rewards) / len(rewards)
    variance = sum((reward - mean) ** 2 for reward in rewards) / len(rewards)
    if variance == 0.0:
        return [0.0] * len(rewards)
    std = math.sqrt(variance)
    return [(reward - mean) / (std + epsilon) for reward in rewards]
