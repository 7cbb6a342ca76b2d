"""ReasoningParser edges: different reasoning separators arriving in one chunk each become a
newline in their order, and finishing flushes the held-back text only once."""

from __future__ import annotations

from cleave.generation.reasoning import Phase, ReasoningParser
from cleave.generation.reasoning_formats import FORMATS

SEPARATE_ANALYSIS = "<|end|><|start|>assistant<|channel|>analysis<|message|>"
SEPARATE_COMMENTARY = "<|end|><|start|>assistant<|channel|>commentary<|message|>"
FINAL = "<|end|><|start|>assistant<|channel|>final<|message|>"


def test_different_separators_in_one_chunk_each_become_a_newline_in_order():
    text = f"<|channel|>analysis<|message|>A.{SEPARATE_ANALYSIS}B.{SEPARATE_COMMENTARY}C.{FINAL}X"
    for chunks in ([text], list(text)):  # the whole text at once, and one character at a time
        parser = ReasoningParser.for_config(FORMATS["gpt_oss"])
        deltas = [parser.feed(chunk) for chunk in chunks] + [parser.finish()]
        assert ("".join(d.reasoning for d in deltas), "".join(d.content for d in deltas)) == ("A.\nB.\nC.", "X")
    parser = ReasoningParser.for_config(FORMATS["gpt_oss"])  # the later separator first: same split
    delta = parser.feed(f"<|channel|>analysis<|message|>A.{SEPARATE_COMMENTARY}B.{SEPARATE_ANALYSIS}C.")
    assert delta.reasoning == "A.\nB.\nC." and parser.phase is Phase.REASONING


def test_finishing_flushes_the_held_back_text_only_once():
    parser = ReasoningParser()
    assert parser.feed("<think>a</thi").reasoning == "a"  # "</thi" could begin the end tag: held back
    first = parser.finish()
    assert (first.reasoning, first.content) == ("</thi", "")
    second = parser.finish()
    assert (second.reasoning, second.content) == ("", "")
