"""Thinking budgets of reasoning models, enforced on token ids.

`ThinkingBudget` is a logits processor of the sampler: it forces the end-of-thinking tag
once `max_thinking_tokens` thinking tokens were generated and forbids it before
`min_thinking_tokens`. Splitting thinking text from the answer is torch-free and lives in
`cleave.generation.reasoning`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from cleave.generation.reasoning import Phase
from cleave.generation.sampling_params import SamplingParams


def _suffix_match(token_ids: Sequence[int], tag: Sequence[int]) -> int:
    """Longest k < len(tag) such that token_ids ends with tag[:k]."""
    for length in range(min(len(tag) - 1, len(token_ids)), 0, -1):
        if list(token_ids[len(token_ids) - length :]) == list(tag[:length]):
            return length
    return 0


class ThinkingBudget:
    """Logits processor enforcing a sample's thinking budget by token ids.

    Thinking tokens are those generated inside the block: after the start tag, up to but
    not including the token that completes the end tag. With `num_thinking_tokens >= max_thinking_tokens` the next token of
    the end tag is forced (every other logit -inf; a multi-token tag is forced token by
    token, continuing a tag the model already began). While
    `num_thinking_tokens < min_thinking_tokens` the token that would complete the end tag
    gets logit -inf; when the tag opens with a marker token that is never text (harmony's
    `<|end|>`, a special token), that first token is the one forbidden instead, so the model
    cannot begin the tag at all (forbidding its last token would leave a begun tag behind).
    When the budget cut the block short, `answer_prefix_ids` (a model's
    own answer opening, e.g. " The answer is") are forced next, so a model that would
    otherwise keep reasoning outside the block goes straight to a well-formed answer.

    Args:
        end_token_ids: token ids of the end tag (e.g. `</think>`), in order.
        max_thinking_tokens / min_thinking_tokens: the budget (None: no maximum).
        start_token_ids: token ids of the start tag; needed unless starts_in_reasoning.
        starts_in_reasoning: the prompt already opened the thinking block.
        answer_prefix_ids: tokens forced after an end tag that the budget imposed.
        end_opens_with_marker: the end tag's first token is a special token (never text).
    """

    def __init__(
        self,
        end_token_ids: Sequence[int],
        max_thinking_tokens: int | None = None,
        min_thinking_tokens: int = 0,
        start_token_ids: Sequence[int] | None = None,
        starts_in_reasoning: bool = True,
        answer_prefix_ids: Sequence[int] = (),
        end_opens_with_marker: bool = False,
    ) -> None:
        if not end_token_ids:
            raise ValueError("end_token_ids must name at least one token (the end tag)")
        if not starts_in_reasoning and not start_token_ids:
            raise ValueError("start_token_ids are needed when thinking is not open at the start")
        self._end = list(end_token_ids)
        self._start = list(start_token_ids or [])
        self.max_thinking_tokens = max_thinking_tokens
        self.min_thinking_tokens = min_thinking_tokens
        self._phase = Phase.REASONING if starts_in_reasoning else Phase.BEFORE
        self._recent: list[int] = []  # last few tokens, enough to match either tag
        self._num_seen = 0
        self.num_thinking_tokens = 0
        self._answer_prefix = list(answer_prefix_ids)
        # the token min_thinking_tokens forbids, and how much of the tag must precede it
        self._blocked_at = 0 if end_opens_with_marker else len(self._end) - 1
        self._was_cut = False  # the budget forced the end tag
        self._num_answer_tokens = 0

    @classmethod
    def from_params(
        cls,
        params: SamplingParams,
        end_token_ids: Sequence[int],
        start_token_ids: Sequence[int] | None = None,
        starts_in_reasoning: bool = True,
        answer_prefix_ids: Sequence[int] = (),
        end_opens_with_marker: bool = False,
    ) -> ThinkingBudget | None:
        """A budget for the request's thinking limits, or None when it sets none."""
        if params.max_thinking_tokens is None and params.min_thinking_tokens == 0:
            return None
        return cls(
            end_token_ids,
            params.max_thinking_tokens,
            params.min_thinking_tokens,
            start_token_ids,
            starts_in_reasoning,
            answer_prefix_ids,
            end_opens_with_marker,
        )

    @property
    def phase(self) -> Phase:
        """Thinking phase after the tokens seen so far."""
        return self._phase

    def __call__(self, output_token_ids: Sequence[int], logits: torch.Tensor) -> torch.Tensor:
        """output_token_ids: the sample's tokens so far; logits: [V], edited in place."""
        for token_id in output_token_ids[self._num_seen :]:
            self._observe(token_id)
        self._num_seen = len(output_token_ids)
        if self._phase is Phase.ANSWER and self._was_cut and self._num_answer_tokens < len(self._answer_prefix):
            return _force(logits, self._answer_prefix[self._num_answer_tokens])
        if self._phase is not Phase.REASONING:
            return logits
        partial = _suffix_match(self._recent, self._end)
        if self.max_thinking_tokens is not None and self.num_thinking_tokens >= self.max_thinking_tokens:
            self._was_cut = True
            return _force(logits, self._end[partial])
        if self.num_thinking_tokens < self.min_thinking_tokens and partial == self._blocked_at:
            logits[self._end[partial]] = -torch.inf
        return logits

    def _observe(self, token_id: int) -> None:
        if self._phase is Phase.ANSWER:
            self._num_answer_tokens += 1
            return
        self._recent.append(token_id)
        keep = max(len(self._end), len(self._start))
        if len(self._recent) > keep:
            del self._recent[: len(self._recent) - keep]
        if self._phase is Phase.BEFORE:
            if self._recent[-len(self._start) :] == self._start:
                self._phase = Phase.REASONING
                self._recent.clear()
        elif self._phase is Phase.REASONING:
            if self._recent[-len(self._end) :] == self._end:
                self._phase = Phase.ANSWER
            else:
                self.num_thinking_tokens += 1


def _force(logits: torch.Tensor, token_id: int) -> torch.Tensor:
    """Make `token_id` the only possible next token (logits: [V], edited in place)."""
    logits.fill_(-torch.inf)
    logits[token_id] = 0.0
    return logits
