"""Logits of a decode batch: fp32 rows of the lm_head product, on every path."""

import dataclasses

import pytest
import torch

from cleave.model.llama import CausalLM
from tests.graphs.test_runner import tiny_config


def test_cpu_logits_are_the_lm_head_product_in_fp32():
    torch.manual_seed(0)
    model = CausalLM(tiny_config()).eval()
    hidden = torch.randn(3, model.config.hidden_size)
    with torch.no_grad():
        logits = model.compute_logits(hidden)
    assert logits.dtype == torch.float32
    torch.testing.assert_close(logits, hidden @ model.lm_head.weight.t())


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 4, 64])  # 1: the register GEMV; 4 and 64: cuBLAS writing fp32
def test_gpu_bf16_logits_match_the_fp32_product(rows):
    torch.manual_seed(0)
    config = dataclasses.replace(tiny_config(), vocab_size=32000, hidden_size=512, dtype=torch.bfloat16)
    with torch.device("cuda"):
        model = CausalLM(config).to(torch.bfloat16).eval()
        hidden = torch.randn(rows, config.hidden_size, dtype=torch.bfloat16)
    with torch.no_grad():
        logits = model.compute_logits(hidden)
    expected = hidden.float() @ model.lm_head.weight.float().t()
    assert logits.dtype == torch.float32 and logits.shape == (rows, config.vocab_size)
    # at most the bf16 rounding of the output (the GEMV rounds it; cuBLAS keeps fp32)
    torch.testing.assert_close(logits, expected, atol=1e-2, rtol=2 ** -8)
