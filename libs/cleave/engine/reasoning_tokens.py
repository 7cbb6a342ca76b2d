"""Counting thinking tokens by token ids, for engines that make no text.

A decode worker streams token ids and leaves text to the gateway, so it runs no
`ReasoningParser`; it still reports how many tokens each sample spent thinking.
`ReasoningTokenCounter` counts the same tokens the parser counts when the think tags are
tokens of their own: from the start tag (and any blank tokens before it) through the token
that completes the end tag; with `starts_in_reasoning`, from the first output token.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from cleave.generation.reasoning import Phase


class ReasoningTokenCounter:
    """Thinking-token count of one sample, fed one generated token id at a time.

    Args:
        start_token_ids / end_token_ids: token ids of the think tags, in order.
        starts_in_reasoning: the prompt already opened the thinking block.
        is_blank: whether a token's text is whitespace only (blank tokens may precede the
            start tag, as the text parser allows); consulted only before the block opens.
    """

    def __init__(
        self,
        start_token_ids: Sequence[int],
        end_token_ids: Sequence[int],
        starts_in_reasoning: bool = False,
        is_blank: Callable[[int], bool] | None = None,
    ) -> None:
        if not end_token_ids or (not starts_in_reasoning and not start_token_ids):
            raise ValueError("the think tags must encode to at least one token each")
        self._start = list(start_token_ids)
        self._end = list(end_token_ids)
        self._is_blank = is_blank or (lambda token_id: False)
        self._phase = Phase.REASONING if starts_in_reasoning else Phase.BEFORE
        self._recent: list[int] = []  # tag tokens matched so far (before: of the start tag)
        self._num_held = 0  # tokens seen before the block opened
        self.num_reasoning_tokens = 0

    @property
    def phase(self) -> Phase:
        return self._phase

    def feed(self, token_id: int) -> None:
        """Count one generated token."""
        phase = self._phase
        if phase is Phase.ANSWER:
            return
        if phase is Phase.REASONING:
            self.num_reasoning_tokens += 1
            self._match(token_id, self._end, Phase.ANSWER)
            return
        self._num_held += 1
        matched = len(self._recent)
        if matched < len(self._start) and self._start[matched] == token_id:
            self._recent.append(token_id)
            if len(self._recent) == len(self._start):
                self._phase = Phase.REASONING
                self._recent = []
                self.num_reasoning_tokens += self._num_held
        elif matched or not self._is_blank(token_id):
            self._phase = Phase.ANSWER  # something other than the tag opened the output

    def _match(self, token_id: int, tag: list[int], then: Phase) -> None:
        recent = self._recent
        recent.append(token_id)
        if len(recent) > len(tag):
            del recent[0]
        if recent == tag:
            self._phase = then
