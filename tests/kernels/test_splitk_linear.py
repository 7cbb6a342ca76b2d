"""Split-K decode-batch linear (17-64 rows) vs the unfused ops it replaces."""

import pytest
import torch

from cleave.kernels.small_linear import small_linear, small_linear_reference
from cleave.kernels.splitk_linear import choose_split_k
from tests.kernels.test_small_linear import make
from tests.kernels.ulp import assert_close_ulps


def _check(out, expected, dtype):
    if dtype == torch.float32:
        torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)
    else:
        # the normalisation is applied to the product, not rounded into the input
        torch.testing.assert_close(out.float(), expected.float(), rtol=2e-2, atol=3e-2)


@pytest.mark.parametrize(("rows", "split_k", "dtype"), [
    (20, 2, torch.float32),  # ragged K: the last split's range ends mid-tile
    (33, 4, torch.float32),  # more splits than K tiles: one split has no K range and still counts
    (17, 1, torch.float32),  # no split: the epilogue runs in every program
    (24, 2, torch.bfloat16),
])
def test_every_fusion_matches_the_unfused_ops(rows, split_k, dtype):
    # 3 K tiles of 32 (the last ragged), two feature blocks of 16 (the last ragged)
    x, weight, norm_weight, residual = make(rows, 24, 88, True, dtype)
    counters = torch.zeros(8, dtype=torch.int32)
    settings = dict(impl="triton", kernel="splitk", block_n=16, block_k=32, split_k=split_k, counters=counters)

    out = small_linear(x, weight, gated=True, norm_weight=norm_weight, eps=1e-5, **settings)
    _check(out, small_linear_reference(x, weight, gated=True, norm_weight=norm_weight, eps=1e-5), dtype)

    plain = weight[:24]
    out = small_linear(x, plain, norm_weight=norm_weight, eps=1e-5, **settings)
    _check(out, small_linear_reference(x, plain, norm_weight=norm_weight, eps=1e-5), dtype)

    ours, theirs = residual.clone(), residual.clone()
    returned = small_linear(x, plain, add_to=ours, **settings)
    small_linear_reference(x, plain, add_to=theirs)
    assert returned is ours
    if dtype == torch.float32:
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    else:  # split partial sums round differently; the interpreter also truncates casts
        assert_close_ulps(ours, theirs, ulps=2, atol=3e-2)
    assert not counters.any()  # every launch leaves the counters as it found them


def test_auto_takes_split_k_above_sixteen_rows_and_allocates_counters():
    x, weight, _, _ = make(40, 16, 64, False)
    out = small_linear(x, weight, impl="triton", block_n=16, block_k=16, split_k=2)
    torch.testing.assert_close(out, small_linear_reference(x, weight), rtol=1e-5, atol=1e-5)


def test_split_k_choice_fills_the_grid_within_its_bounds():
    # Llama-3.2-1B at 64 rows, block_n 64, block_k 128
    assert choose_split_k(num_blocks=32, k_tiles=64, block_k=128, block_m=64) == 8  # down: 256 programs
    assert choose_split_k(num_blocks=128, k_tiles=16, block_k=128, block_m=64) == 2  # gate_up: 256 programs
    assert choose_split_k(num_blocks=48, k_tiles=16, block_k=128, block_m=64) == 4  # qkv: partials bound it
    assert choose_split_k(num_blocks=512, k_tiles=16, block_k=128, block_m=64) == 1
    assert choose_split_k(num_blocks=1, k_tiles=3, block_k=128, block_m=16) == 1  # two tiles per split at least


def test_rejects_what_it_cannot_do():
    x, weight, _, _ = make(20, 16, 32, False)
    with pytest.raises(ValueError, match="out_dtype"):
        small_linear(x, weight, impl="triton", kernel="splitk", out_dtype=torch.float64)
    with pytest.raises(ValueError, match="kernel must be"):
        small_linear(x, weight, impl="triton", kernel="cublas")


def _assert_within_bf16_rounding(out: torch.Tensor, expected: torch.Tensor) -> None:
    # The split-K kernel rounds the weight-scaled input once and normalises the product, so
    # it is held to the fp32 result of the same maths: within a few bf16 ulps of the output's
    # scale (a lost or doubled split would be off by whole units).
    scale = expected.abs().max().item()
    error = (out.float() - expected).abs().max().item()
    assert error <= 2**-6 * scale, f"max error {error:.4f} for outputs up to {scale:.2f}"


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [17, 32, 64])
@pytest.mark.parametrize(("num_out", "num_in", "gated"), [(3072, 2048, False), (8192, 2048, True), (2048, 8192, False)])
def test_gpu_bf16_llama_shapes(rows, num_out, num_in, gated):
    x, weight, norm_weight, residual = make(rows, num_out, num_in, gated, torch.bfloat16, "cuda")
    counters = torch.zeros(1024, dtype=torch.int32, device="cuda")
    out = small_linear(x, weight, gated=gated, norm_weight=norm_weight, kernel="splitk", counters=counters)
    expected = small_linear_reference(x.float(), weight.float(), gated=gated, norm_weight=norm_weight.float())
    _assert_within_bf16_rounding(out, expected)
    if not gated:
        ours = residual.clone()
        small_linear(x, weight, add_to=ours, kernel="splitk", counters=counters)
        _assert_within_bf16_rounding(ours, residual.float() + small_linear_reference(x.float(), weight.float()))
    assert not counters.any()
