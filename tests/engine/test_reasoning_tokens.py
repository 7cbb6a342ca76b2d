"""ReasoningTokenCounter: thinking tokens by id, the same count as the text parser's."""

from __future__ import annotations

import pytest

from cleave.engine.reasoning_tokens import ReasoningTokenCounter
from cleave.generation.reasoning import Phase, ReasoningParser

# A toy vocabulary: multi-token tags "<think>" = [1, 2], "</think>" = [3, 4]; 9 is a blank.
TEXT = {1: "<thi", 2: "nk>", 3: "</thi", 4: "nk>", 5: "a", 6: "b", 7: "c", 9: " "}


def parser_count(tokens: list[int], starts_in_reasoning: bool) -> int:
    parser = ReasoningParser("<think>", "</think>", starts_in_reasoning)
    for token in tokens:
        parser.feed(TEXT[token])
    return parser.num_reasoning_tokens


@pytest.mark.parametrize(
    ("tokens", "starts_in_reasoning", "expected", "phase"),
    [
        ([1, 2, 5, 6, 3, 4, 7, 7], False, 6, Phase.ANSWER),  # tags counted, answer not
        ([9, 9, 1, 2, 5, 3, 4, 6], False, 7, Phase.ANSWER),  # blanks before the tag count too
        ([5, 1, 2, 6, 3, 4], False, 0, Phase.ANSWER),  # text before the tag: all answer
        ([1, 5, 2, 6], False, 0, Phase.ANSWER),  # a broken start tag
        ([5, 6, 3, 4, 7], True, 4, Phase.ANSWER),
        ([5, 3, 6, 3], True, 4, Phase.REASONING),  # an unfinished end tag keeps thinking
    ],
)
def test_counts_like_the_text_parser(tokens, starts_in_reasoning, expected, phase):
    counter = ReasoningTokenCounter([1, 2], [3, 4], starts_in_reasoning, is_blank=lambda t: TEXT[t].isspace())
    for token in tokens:
        counter.feed(token)
    assert counter.num_reasoning_tokens == expected == parser_count(tokens, starts_in_reasoning)
    assert counter.phase is phase
