"""ReasoningParser on split tags; ThinkingBudget on a toy logit stream through the Sampler."""

from __future__ import annotations

import random

import pytest
import torch

from cleave.engine.sampler import Sampler
from cleave.engine.sampling_tensors import SamplingTensors
from cleave.engine.thinking_budget import ThinkingBudget
from cleave.generation.reasoning import Phase, ReasoningParser
from cleave.generation.sampling_params import SamplingParams


def _run(parser: ReasoningParser, chunks: list[str]) -> tuple[str, str, list]:
    deltas = [parser.feed(chunk) for chunk in chunks]
    deltas.append(parser.finish())
    return "".join(d.reasoning for d in deltas), "".join(d.content for d in deltas), deltas


def _random_chunks(text: str, rng: random.Random) -> list[str]:
    cuts = sorted(set(rng.randint(0, len(text)) for _ in range(rng.randint(0, len(text)))))
    return [text[i:j] for i, j in zip([0, *cuts], [*cuts, len(text)])]


@pytest.mark.parametrize(
    "text, starts_in_reasoning, reasoning, content",
    [
        (" \n<think>\nLet me see: 2 + 2.</think>\n\nIt is 4.", False, "\nLet me see: 2 + 2.", "\n\nIt is 4."),
        ("Compare a < b and a </ b.</think>Done", True, "Compare a < b and a </ b.", "Done"),
        ("No thinking here <think>x</think>", False, "", "No thinking here <think>x</think>"),
        ("<think>still thinking </thi", False, "still thinking </thi", ""),
        ("<thi", False, "", "<thi"),
        ("</think>", True, "", ""),
    ],
)
def test_every_chunking_gives_the_same_split(text, starts_in_reasoning, reasoning, content):
    rng = random.Random(0)
    chunkings = [list(text), [text]] + [_random_chunks(text, rng) for _ in range(50)]
    for chunks in chunkings:
        parser = ReasoningParser(starts_in_reasoning=starts_in_reasoning)
        got_reasoning, got_content, deltas = _run(parser, chunks)
        assert (got_reasoning, got_content) == (reasoning, content), chunks


def test_partial_tags_are_never_streamed():
    parser = ReasoningParser()
    deltas = [parser.feed(c) for c in ["<", "th", "ink>", "ab", "</", "thi", "nk>", "ans"]]
    assert [(d.reasoning, d.content) for d in deltas] == [
        ("", ""), ("", ""), ("", ""), ("ab", ""), ("", ""), ("", ""), ("", ""), ("", "ans")
    ]
    assert parser.phase is Phase.ANSWER


def test_reasoning_token_counts():
    parser = ReasoningParser()
    for token_text in ["<th", "ink>", "a", "b", "</", "think>", "c", "d"]:
        parser.feed(token_text)
    # Held-back start-tag tokens count once the tag completes; end-tag tokens count too.
    assert parser.num_reasoning_tokens == 6
    parser = ReasoningParser(starts_in_reasoning=True)
    parser.feed("x", num_tokens=3)
    parser.feed("", num_tokens=1)  # a token whose text the detokenizer still holds back
    parser.feed("</think>ok", num_tokens=2)
    assert parser.num_reasoning_tokens == 6
    answer_only = ReasoningParser()
    answer_only.feed("Hi", num_tokens=2)
    assert answer_only.num_reasoning_tokens == 0 and answer_only.phase is Phase.ANSWER


VOCAB = 10


def _generate(budget: ThinkingBudget, preferred: list[int], steps: int) -> list[int]:
    """Greedy decoding where the toy model prefers `preferred[step]`, then token 0."""
    sampler = Sampler()
    output: list[int] = []
    params = [SamplingParams(temperature=0.0)]
    for step in range(steps):
        logits = torch.zeros(1, VOCAB)
        logits[0, 0] = 1.0
        logits[0, preferred[step]] = 2.0
        state = SamplingTensors.from_params(
            params, vocab_size=VOCAB, device="cpu", output_token_ids=[output],
            logits_processors=[[budget]],
        )
        output = output + sampler.sample(logits, state).token_ids.tolist()
    return output


def test_max_thinking_forces_single_token_end_tag():
    budget = ThinkingBudget(end_token_ids=[3], max_thinking_tokens=4)
    assert _generate(budget, [1] * 7, 7) == [1, 1, 1, 1, 3, 1, 1]
    assert budget.num_thinking_tokens == 4 and budget.phase is Phase.ANSWER


def test_min_thinking_suppresses_end_tag():
    budget = ThinkingBudget(end_token_ids=[3], min_thinking_tokens=3)
    assert _generate(budget, [3] * 5, 5) == [0, 0, 0, 3, 3]


def test_multi_token_end_tag_is_forced_in_sequence_and_continues_a_started_tag():
    budget = ThinkingBudget(end_token_ids=[5, 6, 7], max_thinking_tokens=3)
    assert _generate(budget, [1] * 8, 8) == [1, 1, 1, 5, 6, 7, 1, 1]
    budget = ThinkingBudget(end_token_ids=[5, 6, 7], max_thinking_tokens=3)
    assert _generate(budget, [1, 1, 5, 1, 1, 1], 6) == [1, 1, 5, 6, 7, 1]


def test_min_thinking_blocks_only_the_completing_token_of_a_multi_token_tag():
    budget = ThinkingBudget(end_token_ids=[5, 6], min_thinking_tokens=4)
    assert _generate(budget, [5, 6, 5, 6, 5, 6, 2], 7) == [5, 0, 5, 0, 5, 6, 2]


def test_min_thinking_blocks_the_first_token_of_a_tag_that_opens_with_a_marker():
    budget = ThinkingBudget(end_token_ids=[5, 6], min_thinking_tokens=4, end_opens_with_marker=True)
    assert _generate(budget, [5, 6, 5, 6, 5, 6, 2], 7) == [0, 6, 0, 6, 5, 6, 2]
    assert budget.num_thinking_tokens == 5 and budget.phase is Phase.ANSWER  # the tag's 5 counts (see class doc)


def test_budget_counts_only_after_start_tag_when_model_opens_the_block():
    budget = ThinkingBudget(end_token_ids=[3], max_thinking_tokens=2, start_token_ids=[4],
                            starts_in_reasoning=False)
    assert _generate(budget, [1, 1, 4, 1, 1, 1, 1], 7) == [1, 1, 4, 1, 1, 3, 1]


def test_zero_budget_and_from_params():
    assert ThinkingBudget.from_params(SamplingParams(), end_token_ids=[3]) is None
    budget = ThinkingBudget.from_params(SamplingParams(max_thinking_tokens=0), end_token_ids=[3])
    assert _generate(budget, [1, 1], 2) == [3, 1]
    with pytest.raises(ValueError):
        ThinkingBudget(end_token_ids=[3], starts_in_reasoning=False)


def test_a_cut_block_is_followed_by_the_forced_answer_prefix():
    budget = ThinkingBudget(end_token_ids=[3], max_thinking_tokens=2, answer_prefix_ids=[8, 9])
    assert _generate(budget, [1] * 7, 7) == [1, 1, 3, 8, 9, 1, 1]


def test_a_block_the_model_closes_itself_gets_no_answer_prefix():
    budget = ThinkingBudget(end_token_ids=[3], max_thinking_tokens=5, answer_prefix_ids=[8, 9])
    assert _generate(budget, [1, 3, 1, 1, 1], 5) == [1, 3, 1, 1, 1]
