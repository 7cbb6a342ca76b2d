"""Reasoning models: how they mark thinking, and splitting thinking text from the answer.

`ReasoningConfig` is the model's tags (from `cleave_config.json`, or a named format that
`cleave.generation.reasoning_formats` picks for the checkpoint). `ReasoningParser` works on
streamed text: it separates the `<think>...</think>` block from the answer, holding back any
text that could be the start of a tag split across tokens, and counts the tokens spent
thinking. It supports both conventions: the model opens the block itself (Qwen3:
`starts_in_reasoning=False`) or the chat template opened it in the prompt (DeepSeek-R1:
`starts_in_reasoning=True`). A tag may be several tokens (gpt-oss's harmony headers), and a
model may open its answer with a header of its own instead of thinking (`answer_tags`).

Torch-free: the gateway splits text with it; the engine's `ThinkingBudget` enforces budgets
on token ids and shares `Phase`.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class ReasoningConfig:
    """How a reasoning model marks its thinking (from `cleave_config.json`, or a named format)."""

    start_tag: str = "<think>"
    end_tag: str = "</think>"
    starts_in_reasoning: bool = False
    answer_prefix: str = ""  # forced after a thinking budget cuts the block (e.g. " The answer is")
    # Headers that open the answer when the model skips the thinking block (harmony's
    # `<|channel|>final<|message|>`): removed from the text, like the tags.
    answer_tags: tuple[str, ...] = ()
    # Boundaries between messages that all belong to the thinking (harmony's end of one
    # analysis message and start of the next): a newline in the reasoning text, which
    # continues, as vLLM joins a gpt-oss turn's messages before the final one.
    reasoning_separators: tuple[str, ...] = ()

    @property
    def tags(self) -> tuple[str, ...]:
        """Every marker the parser looks for: start, end and answer tags, separators."""
        return (self.start_tag, self.end_tag, *self.answer_tags, *self.reasoning_separators)


def read_reasoning_config(model_dir: str | Path) -> ReasoningConfig | None:
    """The `reasoning` section of `cleave_config.json` in the model directory, if any."""
    path = Path(model_dir) / "cleave_config.json"
    if not path.is_file():
        return None
    section = json.loads(path.read_text(encoding="utf-8")).get("reasoning")
    if not section:
        return None
    tag_lists = {}
    for key in ("answer_tags", "reasoning_separators"):
        tags = section.get(key, [])
        if not isinstance(tags, list) or not all(isinstance(tag, str) and tag for tag in tags):
            raise ValueError(f"{path}: reasoning.{key} must be a list of non-empty strings, got {tags!r}")
        tag_lists[key] = tuple(tags)
    return ReasoningConfig(
        start_tag=section.get("start_tag", "<think>"),
        end_tag=section.get("end_tag", "</think>"),
        starts_in_reasoning=bool(section.get("starts_in_reasoning", False)),
        answer_prefix=section.get("answer_prefix", ""),
        **tag_lists,
    )


class Phase(enum.Enum):
    """Where a sample is relative to its thinking block."""

    BEFORE = "before"  # the block has not opened yet
    REASONING = "reasoning"
    ANSWER = "answer"  # the block closed (or never opened): everything is answer text


@dataclass
class ReasoningDelta:
    """Text separated from one chunk of output: thinking and answer parts."""

    reasoning: str = ""
    content: str = ""


def longest_suffix_prefix(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for length in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:length]):
            return length
    return 0


class ReasoningParser:
    """Streaming separation of reasoning text from answer text for one sample.

    Only one thinking block is recognized, at the start of the output (after optional
    whitespace, which is dropped); text before any start tag that is not whitespace makes
    the whole output an answer, except an answer tag, which opens the answer and is dropped.
    Tags are removed from both parts; a reasoning separator inside the block becomes a
    newline of the reasoning.

    Args:
        start_tag / end_tag: the block's delimiters.
        starts_in_reasoning: the prompt already opened the block.
        answer_tags: headers that open the answer in place of a thinking block.
        reasoning_separators: boundaries between messages of the thinking block.
    """

    def __init__(
        self,
        start_tag: str = "<think>",
        end_tag: str = "</think>",
        starts_in_reasoning: bool = False,
        answer_tags: Sequence[str] = (),
        reasoning_separators: Sequence[str] = (),
    ) -> None:
        self.start_tag = start_tag
        self.end_tag = end_tag
        self.answer_tags = tuple(answer_tags)
        self.reasoning_separators = tuple(reasoning_separators)
        self._phase = Phase.REASONING if starts_in_reasoning else Phase.BEFORE
        self._held_back = ""
        self._held_tokens = 0  # tokens whose phase is undecided while in BEFORE
        self.num_reasoning_tokens = 0

    @classmethod
    def for_config(cls, config: ReasoningConfig) -> ReasoningParser:
        """A parser of one sample of a model with these tags."""
        return cls(config.start_tag, config.end_tag, config.starts_in_reasoning, config.answer_tags,
                   config.reasoning_separators)

    @property
    def phase(self) -> Phase:
        """Current phase."""
        return self._phase

    def feed(self, text: str, num_tokens: int = 1) -> ReasoningDelta:
        """Add the text of `num_tokens` new tokens; return what can be shown now."""
        delta = ReasoningDelta()
        if self._phase is Phase.BEFORE:
            self._held_tokens += num_tokens
            text = self._feed_before(text, delta)
            if self._phase is Phase.BEFORE:
                return delta
            num_tokens = 0
        if self._phase is Phase.REASONING:
            self.num_reasoning_tokens += num_tokens
            text = self._feed_reasoning(text, delta)
        if self._phase is Phase.ANSWER:
            delta.content += text
        return delta

    def finish(self) -> ReasoningDelta:
        """Flush held-back text at the end of the output."""
        held, self._held_back = self._held_back, ""
        if self._phase is Phase.REASONING:
            return ReasoningDelta(reasoning=held)
        return ReasoningDelta(content=held)

    def _feed_before(self, text: str, delta: ReasoningDelta) -> str:
        buffer = self._held_back + text
        stripped = buffer.lstrip()
        if stripped.startswith(self.start_tag):
            self._held_back = ""
            self._phase = Phase.REASONING
            self.num_reasoning_tokens += self._held_tokens
            return stripped[len(self.start_tag) :]
        answer_tag = next((tag for tag in self.answer_tags if stripped.startswith(tag)), None)
        if answer_tag is not None:
            self._held_back = ""
            self._phase = Phase.ANSWER
            return stripped[len(answer_tag) :]
        if any(tag.startswith(stripped) for tag in (self.start_tag, *self.answer_tags)):
            self._held_back = buffer  # whitespace or a partial start or answer tag
            return ""
        self._held_back = ""
        self._phase = Phase.ANSWER
        return buffer

    def _feed_reasoning(self, text: str, delta: ReasoningDelta) -> str:
        buffer = self._held_back + text
        while True:
            end_at = buffer.find(self.end_tag)
            separator, separator_at = self._first_separator(buffer)
            if separator_at == -1 or (end_at != -1 and end_at <= separator_at):
                break
            delta.reasoning += buffer[:separator_at] + "\n"
            buffer = buffer[separator_at + len(separator) :]
        if end_at != -1:
            self._held_back = ""
            self._phase = Phase.ANSWER
            delta.reasoning += buffer[:end_at]
            return buffer[end_at + len(self.end_tag) :]
        hold = max(longest_suffix_prefix(buffer, tag) for tag in (self.end_tag, *self.reasoning_separators))
        self._held_back = buffer[len(buffer) - hold :]
        delta.reasoning += buffer[: len(buffer) - hold]
        return ""

    def _first_separator(self, buffer: str) -> tuple[str, int]:
        """The reasoning separator that occurs first in `buffer` and where (-1: none)."""
        found = [(at, separator) for separator in self.reasoning_separators if (at := buffer.find(separator)) != -1]
        if not found:
            return "", -1
        at, separator = min(found)
        return separator, at
