"""ThinkingBudget edges on a toy logit stream through the Sampler: a start tag longer than the
end tag is still recognised, and the start tag's tokens never count toward the end tag."""

from __future__ import annotations

import torch

from cleave.engine.sampler import Sampler
from cleave.engine.sampling_tensors import SamplingTensors
from cleave.engine.thinking_budget import ThinkingBudget
from cleave.generation.reasoning import Phase
from cleave.generation.sampling_params import SamplingParams

VOCAB = 10


def _generate(budget: ThinkingBudget, preferred: list[int]) -> list[int]:
    """Greedy decoding where the toy model prefers `preferred[step]`, then token 0."""
    sampler, output = Sampler(), []
    for token_id in preferred:
        logits = torch.zeros(1, VOCAB)
        logits[0, 0] = 1.0
        logits[0, token_id] = 2.0
        state = SamplingTensors.from_params([SamplingParams(temperature=0.0)], vocab_size=VOCAB, device="cpu",
                                            output_token_ids=[output], logits_processors=[[budget]])
        output = output + sampler.sample(logits, state).token_ids.tolist()
    return output


def test_a_start_tag_longer_than_the_end_tag_opens_the_block():
    budget = ThinkingBudget(end_token_ids=[3], max_thinking_tokens=2, start_token_ids=[4, 5, 6],
                            starts_in_reasoning=False)
    assert _generate(budget, [1, 4, 5, 6, 1, 1, 1, 1]) == [1, 4, 5, 6, 1, 1, 3, 1]
    assert budget.phase is Phase.ANSWER and budget.num_thinking_tokens == 2


def test_the_start_tags_tokens_never_count_toward_the_end_tag():
    # the start tag ends with the end tag's first token: 6 right after the start tag is thinking
    budget = ThinkingBudget(end_token_ids=[5, 6], max_thinking_tokens=2, start_token_ids=[4, 5],
                            starts_in_reasoning=False)
    assert _generate(budget, [4, 5, 6, 1, 1, 1, 1, 1]) == [4, 5, 6, 1, 5, 6, 1, 1]
    assert budget.phase is Phase.ANSWER and budget.num_thinking_tokens == 3  # 6, 1 and the tag's 5
