"""Prompt logprobs from the prefill forward match transformers' log-softmax of the same
checkpoint, whole or chunked, with the prefix cache warm, and beside requests without them."""

from __future__ import annotations

import pytest
import torch

from cleave.engine.llm import LLM
from cleave.generation.sampling_params import SamplingParams
from cleave.testing.tiny_models import write_tiny_checkpoint

PROMPT = [5, 17, 42, 9, 33, 71, 2, 88, 14, 60, 23, 47, 31, 8, 99, 64, 12, 3, 77, 50]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "llama", "llama", seed=3)


@pytest.fixture(scope="module")
def hf_logprobs(checkpoint) -> torch.Tensor:
    """[P, V] log-softmax of transformers' logits over PROMPT."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([PROMPT])).logits[0]
    return torch.log_softmax(logits.float(), dim=-1)


def engine(checkpoint, **kwargs) -> LLM:
    return LLM(checkpoint, device="cpu", dtype="float32", enforce_eager=True, max_model_len=64, num_blocks=32,
               block_size=4, **kwargs)


def expected(hf_logprobs: torch.Tensor) -> list[float]:
    """Logprob of prompt token p + 1 at position p."""
    return [hf_logprobs[p, PROMPT[p + 1]].item() for p in range(len(PROMPT) - 1)]


@pytest.mark.parametrize("max_num_batched_tokens", [64, 7])  # whole; chunks that end mid-block
def test_prompt_logprobs_match_transformers(checkpoint, hf_logprobs, max_num_batched_tokens):
    llm = engine(checkpoint, max_num_batched_tokens=max_num_batched_tokens)
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=2)
    (output,) = llm.generate(PROMPT, params)
    scores = output.prompt_logprobs
    assert scores is not None and len(scores) == len(PROMPT) and scores[0] is None
    assert [entry.token_id for entry in scores[1:]] == PROMPT[1:]
    assert [entry.logprob for entry in scores[1:]] == pytest.approx(expected(hf_logprobs), abs=1e-4)
    top_values, top_ids = hf_logprobs[:-1].topk(2, dim=-1)
    assert [entry.top_token_ids for entry in scores[1:]] == top_ids.tolist()
    for entry, values in zip(scores[1:], top_values.tolist()):
        assert entry.top_logprobs == pytest.approx(values, abs=1e-4)
    for position, entry in enumerate(scores[1:]):  # vLLM's rank: tokens at least as likely, itself included
        row, target = hf_logprobs[position], hf_logprobs[position, PROMPT[position + 1]]
        assert (row > target + 1e-4).sum().item() + 1 <= entry.rank <= (row >= target - 1e-4).sum().item()
    assert max(entry.rank for entry in scores[1:]) > 2  # some token outside the top 2: ranked all the same


def test_a_cached_prefix_is_scored_again_and_others_are_not_scored(checkpoint, hf_logprobs):
    llm = engine(checkpoint)
    (plain,) = llm.generate(PROMPT, SamplingParams(max_tokens=2, temperature=0.0))  # warms the prefix cache
    assert plain.prompt_logprobs is None
    scored, other = llm.generate(
        [PROMPT, PROMPT[:9]],
        [SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=0), SamplingParams(max_tokens=2, temperature=0.0)],
    )
    assert [entry.logprob for entry in scored.prompt_logprobs[1:]] == pytest.approx(expected(hf_logprobs), abs=1e-4)
    assert all(entry.top_token_ids == [] for entry in scored.prompt_logprobs[1:])
    assert other.prompt_logprobs is None
    assert scored.outputs[0].token_ids == plain.outputs[0].token_ids  # scoring leaves sampling alone


def test_a_one_token_prompt_has_one_empty_score(checkpoint):
    (output,) = engine(checkpoint).generate([PROMPT[0]], SamplingParams(max_tokens=1, prompt_logprobs=1))
    assert output.prompt_logprobs == [None]
