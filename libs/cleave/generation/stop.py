"""Stop conditions of one sample: stop strings, stop token ids, eos and max_tokens.

Stop strings are matched on text, which may span tokens. While streaming, text that could
still turn out to be the start of a stop string is held back, so a client never sees part
of a stop string; once a stop string completes, the output is cut before it (OpenAI: the
stop string is not part of the output), or after it with `include_stop_str` (vLLM's
`include_stop_str_in_output`, which also keeps the text of a stop token id).

Why only held-back text needs searching: text is emitted only up to the longest suffix that
is a prefix of some stop string, so no stop string can start inside already-emitted text.
Each step therefore searches `held_back + new_text`, a few characters, not the whole output.

Per generated token the engine calls `process(token_id, detokenizer)`; the pieces
(`check_token`, `append_text`) are public for callers that detokenize elsewhere.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Protocol

from cleave.generation.outputs import FinishReason
from cleave.generation.sampling_params import SamplingParams


class TokenDetokenizer(Protocol):
    """The part of `IncrementalDetokenizer` that `StopChecker.process` uses."""

    def push(self, token_id: int) -> str: ...

    def finish(self) -> str: ...


@dataclass
class TokenStop:
    """A stop decided by a token id alone.

    Attributes:
        finish_reason: STOP (eos or stop token id) or LENGTH (max tokens reached).
        stop_reason: the stop token id, or None for eos and length.
        include_token_text: whether the token's own text belongs to the output.
    """

    finish_reason: FinishReason
    stop_reason: int | None
    include_token_text: bool


@dataclass
class StopUpdate:
    """Result of one step: text now safe to stream and, if the sample ended, why.

    Attributes:
        text: new output text (held-back stop-string prefixes excluded until resolved).
        finish_reason: None while the sample continues.
        stop_reason: the matched stop string or stop token id, if any.
    """

    text: str
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None

    @property
    def finished(self) -> bool:
        """True when the sample ended this step."""
        return self.finish_reason is not None


# Characters of held-back text `StopChecker._stop_prefix_length` searches stop strings for at once.
_TAIL = 16


class StopChecker:
    """Stop-condition state of one sample.

    Args:
        params: the request's sampling parameters (stop, stop_token_ids, ignore_eos,
            min_tokens: neither stop ids nor stop strings end a sample shorter than it).
        eos_token_ids: the model's end-of-sequence ids.
        max_new_tokens: most tokens to generate (`params.max_new_tokens(...)` resolves
            max_tokens=None against the context window); None: no limit here.
        include_stop_str: a stop string that ends the sample stays in its text, and so does
            the text of the eos or stop token id that ends it (vLLM's
            `include_stop_str_in_output`).
    """

    def __init__(
        self,
        params: SamplingParams,
        eos_token_ids: Collection[int] = (),
        max_new_tokens: int | None = None,
        include_stop_str: bool = False,
    ) -> None:
        self._include_stop_str = include_stop_str
        self._stop_strings: Sequence[str] = tuple(params.stop)
        self._stop_token_ids = frozenset(params.stop_token_ids)
        self._eos_token_ids = frozenset() if params.ignore_eos else frozenset(eos_token_ids)
        self._max_new_tokens = max_new_tokens if max_new_tokens is not None else params.max_tokens
        # One set for the common "no stop id" test; `check_token` tells eos and stop ids apart after.
        self._any_stop_ids = self._eos_token_ids | self._stop_token_ids
        self._token_limit = self._max_new_tokens if self._max_new_tokens is not None else float("inf")
        self._min_tokens = params.min_tokens  # stop ids and strings end nothing before
        self._num_tokens = 0
        self._held_back = ""
        self._emitted: list[str] = []
        self._finished = False

    @property
    def text(self) -> str:
        """Output text emitted so far (cut before a stop string once one matched)."""
        if len(self._emitted) > 1:
            self._emitted = ["".join(self._emitted)]
        return self._emitted[0] if self._emitted else ""

    @property
    def held_back(self) -> str:
        """Text withheld because it may begin a stop string."""
        return self._held_back

    @property
    def has_stop_strings(self) -> bool:
        """Whether text must be searched (and possibly held back) at all."""
        return bool(self._stop_strings)

    @property
    def num_tokens(self) -> int:
        """Tokens seen by `check_token` / `process`."""
        return self._num_tokens

    def check_token(self, token_id: int) -> TokenStop | None:
        """Count one generated token and decide stops that depend only on its id."""
        self._num_tokens += 1
        if token_id in self._any_stop_ids and self._num_tokens > self._min_tokens:
            if token_id in self._eos_token_ids:
                return TokenStop(FinishReason.STOP, None, include_token_text=self._include_stop_str)
            return TokenStop(FinishReason.STOP, token_id, include_token_text=self._include_stop_str)
        if self._num_tokens >= self._token_limit:
            return TokenStop(FinishReason.LENGTH, None, include_token_text=True)
        return None

    def append_text(self, new_text: str, final: bool = False) -> StopUpdate:
        """Add new output text; return what may be streamed and whether a stop string hit.

        With `final`, nothing is held back any more (the sample ends for another reason).
        """
        if self._finished:
            return StopUpdate("")
        if self._num_tokens < self._min_tokens:  # no stop string ends a sample this short
            self._finished = final
            return self._emit(new_text, None, None)
        buffer = self._held_back + new_text
        match_at, matched = self._earliest_stop(buffer)
        if matched is not None:
            self._finished = True
            self._held_back = ""
            end = match_at + len(matched) if self._include_stop_str else match_at
            return self._emit(buffer[:end], FinishReason.STOP, matched)
        hold = 0 if final else self._stop_prefix_length(buffer)
        self._held_back = buffer[len(buffer) - hold :]
        if final:
            self._finished = True
        return self._emit(buffer[: len(buffer) - hold], None, None)

    def process(self, token_id: int, detokenizer: TokenDetokenizer) -> StopUpdate:
        """One generated token through the detokenizer and every stop condition."""
        token_stop = self.check_token(token_id)
        if token_stop is None:
            return self.append_text(detokenizer.push(token_id))
        text = detokenizer.push(token_id) if token_stop.include_token_text else ""
        update = self.append_text(text + detokenizer.finish(), final=True)
        if update.finish_reason is None:
            update.finish_reason = token_stop.finish_reason
            update.stop_reason = token_stop.stop_reason
        return update

    def _emit(self, text: str, reason: FinishReason | None, stop: str | None) -> StopUpdate:
        if text:
            self._emitted.append(text)
        return StopUpdate(text, reason, stop)

    def _earliest_stop(self, buffer: str) -> tuple[int, str | None]:
        best_at, best = len(buffer), None
        for stop in self._stop_strings:
            at = buffer.find(stop, 0, best_at + len(stop) - 1)
            if at != -1 and at < best_at:
                best_at, best = at, stop
        return best_at, best

    def _stop_prefix_length(self, buffer: str) -> int:
        """Length of the longest suffix of `buffer` that is a proper prefix of a stop string.

        A prefix at least `_TAIL` long can match only where the buffer's last `_TAIL` characters
        end it, and `rfind` jumps between those places; shorter ones are compared one by one.
        A held-back tail that stops matching then costs a few searches, not a comparison per
        held-back character: 64 stop strings of 1024 characters, 1000 held back and broken,
        0.2 ms that token against 7 ms (bench/stop_strings.py; bench/results/stop_strings/)."""
        longest, size = 0, len(buffer)
        tail = buffer[size - _TAIL:] if size > _TAIL else ""
        for stop in self._stop_strings:
            end = len(stop) - 1 if len(stop) <= size else size  # candidate lengths are <= end
            if end > _TAIL:  # longer than the tail: only where the tail ends a prefix
                while end > longest:
                    length = stop.rfind(tail, 0, end) + _TAIL
                    if length <= _TAIL or length <= longest:
                        break
                    if buffer.endswith(stop[:length]):
                        longest = length
                        break
                    end = length - 1
                end = _TAIL
            for length in range(end, longest, -1):  # up to the tail's length: each
                if buffer.endswith(stop[:length]):
                    longest = length
                    break
        return longest
