"""Decode-batch GEMV kernel vs the unfused ops it replaces (norm, F.linear, SwiGLU, residual add)."""

import pytest
import torch

from cleave.kernels.small_linear import small_linear, small_linear_reference
from tests.kernels.ulp import assert_close_ulps


def make(rows, num_out, num_in, gated, dtype=torch.float32, device="cpu", seed=0):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, num_in, generator=generator).to(dtype).to(device)
    weight = (torch.randn((2 if gated else 1) * num_out, num_in, generator=generator) * 0.1).to(dtype).to(device)
    norm_weight = (1 + 0.1 * torch.randn(num_in, generator=generator)).to(dtype).to(device)
    residual = torch.randn(rows, num_out, generator=generator).to(dtype).to(device)
    return x, weight, norm_weight, residual


@pytest.mark.parametrize(
    ("rows", "num_out", "num_in", "gated"), [(1, 40, 48, False), (5, 24, 70, True), (16, 16, 32, False), (40, 16, 24, True)]
)
def test_matches_reference_fp32(rows, num_out, num_in, gated):
    x, weight, _, _ = make(rows, num_out, num_in, gated)
    out = small_linear(x, weight, gated=gated, impl="triton", block_n=16, block_k=32)
    assert out.shape == (rows, num_out)
    torch.testing.assert_close(out, small_linear_reference(x, weight, gated), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norm_prologue_and_residual_epilogue(dtype):
    # qkv-style: normalise the residual stream, project; o-style: add the product in place.
    x, weight, norm_weight, residual = make(3, 24, 40, False, dtype)
    normed_out = small_linear(x, weight, norm_weight=norm_weight, eps=1e-5, impl="triton", block_n=16, block_k=16)
    expected = small_linear_reference(x, weight, norm_weight=norm_weight, eps=1e-5)
    atol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(normed_out.float(), expected.float(), rtol=1e-3 if dtype == torch.float32 else 2e-2, atol=atol)

    ours, theirs = residual.clone(), residual.clone()
    returned = small_linear(x, weight, add_to=ours, impl="triton", block_n=16, block_k=16)
    small_linear_reference(x, weight, add_to=theirs)
    assert returned is ours
    if dtype == torch.float32:
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    else:
        # the product may differ by an ulp before the add; the interpreter also truncates casts
        assert_close_ulps(ours, theirs, ulps=2, atol=2e-2)


def test_gated_with_norm_prologue():
    x, weight, norm_weight, _ = make(2, 16, 48, True)
    out = small_linear(x, weight, gated=True, norm_weight=norm_weight, impl="triton", block_n=16, block_k=16)
    expected = small_linear_reference(x, weight, gated=True, norm_weight=norm_weight)
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("kernel", ["dot", "fma"])
@pytest.mark.parametrize(("rows", "dtype"), [(1, torch.float32), (3, torch.float32), (1, torch.bfloat16), (4, torch.bfloat16)])
def test_kernels_agree_on_every_fusion(kernel, rows, dtype):
    # both kernels behind small_linear: two K tiles with a ragged tail, a ragged last feature block
    x, weight, norm_weight, residual = make(rows, 20, 40, True, dtype)
    out = small_linear(x, weight, gated=True, norm_weight=norm_weight, impl="triton", kernel=kernel, block_n=8, block_k=32)
    expected = small_linear_reference(x, weight, gated=True, norm_weight=norm_weight)
    if dtype == torch.float32:
        torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-5)
    else:
        assert_close_ulps(out, expected, ulps=2, atol=2e-2)
    plain_weight = weight[:20]
    ours, theirs = residual.clone(), residual.clone()
    small_linear(x, plain_weight, add_to=ours, impl="triton", kernel=kernel, block_n=8, block_k=32)
    small_linear_reference(x, plain_weight, add_to=theirs)
    if dtype == torch.float32:
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    else:
        assert_close_ulps(ours, theirs, ulps=2, atol=2e-2)


def test_rejects_bad_shapes_naming_the_limit():
    with pytest.raises(ValueError, match="at most 64 rows"):
        small_linear(torch.zeros(65, 8), torch.zeros(8, 8), impl="triton")
    with pytest.raises(ValueError, match="add_to must be"):
        small_linear(torch.zeros(2, 8), torch.zeros(4, 8), add_to=torch.zeros(2, 5), impl="triton")
    with pytest.raises(ValueError, match="at most 4 rows"):
        small_linear(torch.zeros(5, 8), torch.zeros(8, 8), impl="triton", kernel="fma")


@pytest.mark.gpu
@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize(("rows", "kernel"), [(1, "fma"), (1, "dot"), (3, "fma"), (8, "auto"), (64, "auto")])
@pytest.mark.parametrize("num_in", [2048, 8192])
def test_gpu_bf16_llama_shapes(rows, kernel, gated, num_in):
    x, weight, norm_weight, residual = make(rows, 8192 if gated else 2048, num_in, gated, torch.bfloat16, "cuda")
    out = small_linear(x, weight, gated=gated, norm_weight=norm_weight, kernel=kernel)
    expected = small_linear_reference(x, weight, gated=gated, norm_weight=norm_weight)
    torch.testing.assert_close(out.float(), expected.float(), rtol=2e-2, atol=2e-2)
    if not gated:
        ours, theirs = residual.clone(), residual.clone()
        small_linear(x, weight, add_to=ours, kernel=kernel)
        small_linear_reference(x, weight, add_to=theirs)
        torch.testing.assert_close(ours.float(), theirs.float(), rtol=2e-2, atol=2e-2)
