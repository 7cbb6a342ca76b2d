"""The tiny gpt-oss checkpoint gives one oracle whichever transformers release reads it.

The engine tests take transformers' greedy tokens as the truth. transformers releases up to
at least 5.17 apply gpt-oss's clamped SwiGLU with limit 7.0 and alpha 1.702 whatever
config.json says; later ones read both from the config. A tiny checkpoint with other values
is therefore two different models depending on the installed release: with limit 1.0,
transformers 5.17 and 5.25 disagree on the greedy tokens of `test_moe_engine` from the
third token on, while cleave (which reads the config) agrees with 5.25 only. Here the local
release stands in for both: its experts as configured, then with the constants forced.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from cleave.testing.tiny_models import GPT_OSS_SWIGLU_ALPHA, GPT_OSS_SWIGLU_LIMIT, write_tiny_checkpoint

PROMPT_LEN = 40  # well past the first layer's 6-token window


@pytest.fixture(scope="module")
def hf_gpt_oss(tmp_path_factory: pytest.TempPathFactory) -> torch.nn.Module:
    import transformers

    path: Path = write_tiny_checkpoint(tmp_path_factory.mktemp("hf-gpt-oss") / "gpt-oss", "gpt-oss", seed=41)
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _prompt(vocab_size: int) -> torch.Tensor:
    return torch.randint(0, vocab_size, (1, PROMPT_LEN), generator=torch.Generator().manual_seed(7))


def _experts(model: torch.nn.Module) -> list[torch.nn.Module]:
    """transformers' gpt-oss expert modules, which hold the SwiGLU `limit` and `alpha`."""
    experts = [module for module in model.modules() if hasattr(module, "limit") and hasattr(module, "alpha")]
    assert experts, "transformers' gpt-oss experts no longer hold `limit` and `alpha`; find where they went"
    return experts


@torch.no_grad()
def _logits_with_swiglu(model: torch.nn.Module, input_ids: torch.Tensor, limit: float, alpha: float) -> torch.Tensor:
    """[1, S, V] logits with every expert's SwiGLU constants set to (limit, alpha), restored after."""
    experts = _experts(model)
    saved = [(module.limit, module.alpha) for module in experts]
    try:
        for module in experts:
            module.limit, module.alpha = limit, alpha
        return model(input_ids).logits.float()
    finally:
        for module, (old_limit, old_alpha) in zip(experts, saved):
            module.limit, module.alpha = old_limit, old_alpha


@torch.no_grad()
def test_releases_that_fix_the_swiglu_constants_compute_the_same_logits(hf_gpt_oss):
    input_ids = _prompt(hf_gpt_oss.config.vocab_size)
    as_configured = hf_gpt_oss(input_ids).logits.float()
    as_fixed = _logits_with_swiglu(hf_gpt_oss, input_ids, GPT_OSS_SWIGLU_LIMIT, GPT_OSS_SWIGLU_ALPHA)
    assert torch.equal(as_fixed, as_configured)


@torch.no_grad()
def test_the_activations_still_cross_the_swiglu_limit(hf_gpt_oss):
    """The clamp matters for this checkpoint: lifting the limit moves the logits."""
    input_ids = _prompt(hf_gpt_oss.config.vocab_size)
    clamped = _logits_with_swiglu(hf_gpt_oss, input_ids, GPT_OSS_SWIGLU_LIMIT, GPT_OSS_SWIGLU_ALPHA)
    unclamped = _logits_with_swiglu(hf_gpt_oss, input_ids, 1e9, GPT_OSS_SWIGLU_ALPHA)
    assert (clamped - unclamped).abs().max().item() > 1e-2
