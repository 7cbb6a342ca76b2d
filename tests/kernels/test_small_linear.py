"""Decode-batch GEMV kernel vs F.linear (and fused SwiGLU vs silu(gate) * up)."""

import pytest
import torch

from cleave.kernels.small_linear import small_linear, small_linear_reference


@pytest.mark.parametrize(("rows", "num_out", "num_in", "gated"), [(1, 40, 48, False), (5, 24, 70, True), (16, 16, 32, False)])
def test_matches_reference_fp32(rows, num_out, num_in, gated):
    generator = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, num_in, generator=generator)
    weight = torch.randn((2 if gated else 1) * num_out, num_in, generator=generator)
    out = small_linear(x, weight, gated=gated, impl="triton", block_n=16, block_k=32)
    assert out.shape == (rows, num_out)
    torch.testing.assert_close(out, small_linear_reference(x, weight, gated), rtol=1e-5, atol=1e-5)


def test_rejects_too_many_rows_naming_the_limit():
    with pytest.raises(ValueError, match="at most 16 rows"):
        small_linear(torch.zeros(17, 8), torch.zeros(8, 8), impl="triton")


@pytest.mark.gpu
@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("rows", [1, 8])
def test_gpu_bf16_llama_shapes(rows, gated):
    generator = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(rows, 2048, generator=generator, device="cuda").bfloat16()
    weight = (torch.randn(16384 if gated else 3072, 2048, generator=generator, device="cuda") * 0.02).bfloat16()
    out = small_linear(x, weight, gated=gated)
    torch.testing.assert_close(out.float(), small_linear_reference(x, weight, gated).float(), rtol=2e-2, atol=2e-2)
