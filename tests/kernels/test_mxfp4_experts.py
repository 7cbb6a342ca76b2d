"""Expert kernels reading MXFP4 weights packed (per-entry GEMVs and grouped GEMMs), in the
interpreter with tiny shapes: in fp32 against the torch reference on the dequantised weights;
in bf16 against the same kernels on the dequantised weights (the reference rounds gate and up
to bf16 before the activation, the kernels do not, which the clamped SwiGLU and the down sum
widen to a few ulps at these weights; the dense kernels' own bf16 tests cover that rounding).
"""

from __future__ import annotations

import pytest
import torch

from cleave.kernels.fused_moe import fused_experts, grouped_gemm, route
from cleave.kernels.moe_gemv import moe_gemv
from cleave.kernels.moe_reference import MoEActivation, fused_experts_reference, route_reference
from cleave.kernels.moe_tiles import GemmTiles, MoELaunch
from cleave.kernels.mxfp4 import MXFP4Weight
from cleave.kernels.rms_norm import rms_norm_reference
from tests.kernels.test_fused_moe import _assert_close as _assert_close_bf16

# 96 hidden features: three scale groups, a 64-wide K tile and a half-masked second one
EXPERTS, HIDDEN, INTER = 6, 96, 64
CLAMPED = MoEActivation("swiglu_clamped", alpha=1.702, limit=7.0)


def _mxfp4(rows: int, columns: int, generator: torch.Generator) -> MXFP4Weight:
    """Every E2M1 code (random bytes), scales 2^-9 .. 2^-3 (weights up to 0.75)."""
    blocks = torch.randint(0, 256, (EXPERTS, rows, columns // 2), generator=generator, dtype=torch.uint8)
    scales = torch.randint(118, 125, (EXPERTS, rows, columns // 32), generator=generator, dtype=torch.uint8)
    return MXFP4Weight(blocks, scales)


def _experts(dtype: torch.dtype, seed: int):
    generator = torch.Generator().manual_seed(seed)
    w13, w2 = _mxfp4(2 * INTER, HIDDEN, generator), _mxfp4(HIDDEN, INTER, generator)
    w13_bias = (torch.randn(EXPERTS, 2 * INTER, generator=generator) * 0.5).to(dtype)
    w2_bias = (torch.randn(EXPERTS, HIDDEN, generator=generator) * 0.5).to(dtype)
    return w13, w2, w13_bias, w2_bias


def _inputs(num_tokens: int, dtype: torch.dtype, seed: int):
    generator = torch.Generator().manual_seed(seed)
    hidden = (torch.randn(num_tokens, HIDDEN, generator=generator) * 0.3).to(dtype)
    logits = torch.randn(num_tokens, EXPERTS, generator=generator)
    logits[:, :2] += 2.0  # most entries to experts 0 and 1, none to 4 below
    logits[:, 4] = -30.0
    weights, ids = route(logits, 2, impl="torch")
    return hidden, weights, ids


def _assert_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """fp32: the sums agree to fp32 rounding of the largest output (the GEMVs sum each scale
    group first, so near-zero outputs differ relatively); bf16 as the dense kernels' tests."""
    if actual.dtype == torch.float32:
        scale = expected.abs().max().item()
        torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-6 * scale)
    else:
        _assert_close_bf16(actual, expected)


def _reference(hidden, w13, w2, weights, ids, w13_bias, w2_bias, kernel: str = "gemv", **options) -> torch.Tensor:
    """fp32: the torch reference; bf16: `kernel` on the dequantised weights."""
    dense13, dense2 = w13.dequantize(hidden.dtype), w2.dequantize(hidden.dtype)
    if hidden.dtype == torch.float32:
        return fused_experts_reference(hidden, dense13, dense2, weights, ids, CLAMPED, w13_bias, w2_bias)
    if kernel == "gemv":
        return moe_gemv(hidden, dense13, dense2, weights, ids, CLAMPED, w13_bias, w2_bias, **options)
    return fused_experts(hidden, dense13, dense2, weights, ids, CLAMPED, w13_bias, w2_bias, impl="triton",
                         kernel="grouped", **options)


@pytest.mark.parametrize("num_tokens", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_gemvs_match_the_dequantised_reference(num_tokens, dtype):
    w13, w2, w13_bias, w2_bias = _experts(dtype, seed=1)
    hidden, weights, ids = _inputs(num_tokens, dtype, seed=2)
    out = moe_gemv(hidden, w13, w2, weights, ids, CLAMPED, w13_bias, w2_bias)
    _assert_close(out, _reference(hidden, w13, w2, weights, ids, w13_bias, w2_bias))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_gemvs_normalise_their_input_and_add_into_the_residual(dtype):
    w13, w2, w13_bias, w2_bias = _experts(dtype, seed=3)
    residual, weights, ids = _inputs(2, dtype, seed=4)
    norm_weight = (1.0 + 0.1 * torch.randn(HIDDEN, generator=torch.Generator().manual_seed(5))).to(dtype)
    if dtype == torch.float32:
        expected = residual + _reference(rms_norm_reference(residual, norm_weight, 1e-5), w13, w2, weights, ids,
                                         w13_bias, w2_bias)
    else:
        expected = residual.clone()
        _reference(expected, w13, w2, weights, ids, w13_bias, w2_bias, norm_weight=norm_weight, eps=1e-5,
                   add_to=expected)
    stream = residual.clone()
    moe_gemv(stream, w13, w2, weights, ids, CLAMPED, w13_bias, w2_bias, norm_weight=norm_weight, eps=1e-5,
             add_to=stream)
    _assert_close(stream, expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_gemvs_route_inside_their_first_kernel(dtype):
    """gpt-oss's decode MoE layer: router logits over 6 experts (not a power of two) instead of
    the routing, packed weights, biases, the norm prologue and the add epilogue. The routing the
    first kernel writes is `route`'s bit for bit, and the layer is the same GEMVs' given it."""
    w13, w2, w13_bias, w2_bias = _experts(dtype, seed=12)
    residual, _, _ = _inputs(3, dtype, seed=13)
    logits = torch.randn(3, EXPERTS, generator=torch.Generator().manual_seed(14)).to(dtype)
    norm_weight = (1.0 + 0.1 * torch.randn(HIDDEN, generator=torch.Generator().manual_seed(15))).to(dtype)
    routing = (torch.empty(3, 4), torch.empty(3, 4, dtype=torch.int32))
    routed = residual.clone()
    moe_gemv(routed, w13, w2, None, None, CLAMPED, w13_bias, w2_bias, norm_weight=norm_weight, eps=1e-5,
             add_to=routed, router_logits=logits, top_k=4, renormalize=True, routing_out=routing)
    weights, ids = route(logits, 4, True, impl="triton")
    assert torch.equal(routing[0], weights) and torch.equal(routing[1], ids)
    given = residual.clone()
    moe_gemv(given, w13, w2, weights, ids, CLAMPED, w13_bias, w2_bias, norm_weight=norm_weight, eps=1e-5,
             add_to=given)
    assert torch.equal(routed, given) and not torch.equal(routed, residual)
    if dtype == torch.float32:  # and the reference layer (its own routing) on the dequantised weights
        expected = residual + _reference(rms_norm_reference(residual, norm_weight, 1e-5), w13, w2,
                                         *route_reference(logits, 4, True), w13_bias, w2_bias)
        _assert_close(routed, expected)


@pytest.mark.parametrize("launch", [None, MoELaunch(16, GemmTiles(32, 32, 4, 2), GemmTiles(64, 64, 4, 2))])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_grouped_gemms_match_the_dequantised_reference(dtype, launch):
    # 24 tokens x top-2 over 6 experts, most to experts 0-1: groups longer than one block,
    # partial blocks, an expert with none; 32-wide K tiles (one scale group) and 64-wide ones
    w13, w2, w13_bias, w2_bias = _experts(dtype, seed=6)
    hidden, weights, ids = _inputs(24, dtype, seed=7)
    out = fused_experts(hidden, w13, w2, weights, ids, CLAMPED, w13_bias, w2_bias, impl="triton", kernel="grouped",
                        launch=launch)
    _assert_close(out, _reference(hidden, w13, w2, weights, ids, w13_bias, w2_bias, kernel="grouped", launch=launch))


def test_the_torch_path_dequantises():
    w13, w2, w13_bias, w2_bias = _experts(torch.float32, seed=8)
    hidden, weights, ids = _inputs(5, torch.float32, seed=9)
    out = fused_experts(hidden, w13, w2, weights, ids, CLAMPED, w13_bias, w2_bias, impl="torch")
    assert torch.equal(out, _reference(hidden, w13, w2, weights, ids, w13_bias, w2_bias))


def test_packed_weights_refuse_what_the_kernels_cannot_read():
    blocks, scales = torch.zeros(2, 4, 48, dtype=torch.uint8), torch.zeros(2, 4, 3, dtype=torch.uint8)
    assert MXFP4Weight(blocks, scales).shape == (2, 4, 96)
    with pytest.raises(ValueError, match="must be uint8"):
        MXFP4Weight(blocks.float(), scales)
    with pytest.raises(ValueError, match="do not match"):
        MXFP4Weight(blocks, scales[:, :, :2])
    with pytest.raises(ValueError, match="contiguous"):
        MXFP4Weight(torch.zeros(2, 48, 4, dtype=torch.uint8).transpose(1, 2), scales)
    w13, _, _, _ = _experts(torch.float32, seed=10)
    hidden, _, ids = _inputs(4, torch.float32, seed=11)
    from cleave.kernels.fused_moe import align_block_size

    aligned = align_block_size(ids, EXPERTS, 16)
    out = torch.empty(8, INTER)
    with pytest.raises(ValueError, match="block_k >= 32"):
        grouped_gemm(hidden, w13, None, out, aligned, GemmTiles(32, 16, 4), 2, CLAMPED, None)


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1, 4, 64, 1024])
def test_gpu_packed_experts_at_gpt_oss_20b_shapes(num_tokens):
    """gpt-oss-20b's experts (32 of 2880 x 2880, top-4, biased, clamped SwiGLU) in bf16 on the
    GPU: the packed kernels against the same kernels on the dequantised weights (GEMVs up to
    four tokens, grouped GEMMs beyond)."""
    experts, hidden_size, inter, top_k = 32, 2880, 2880, 4
    generator = torch.Generator(device="cuda").manual_seed(num_tokens)

    def packed(rows: int, columns: int) -> MXFP4Weight:
        return MXFP4Weight(
            torch.randint(0, 256, (experts, rows, columns // 2), device="cuda", dtype=torch.uint8, generator=generator),
            torch.randint(119, 123, (experts, rows, columns // 32), device="cuda", dtype=torch.uint8,
                          generator=generator),
        )

    w13, w2 = packed(2 * inter, hidden_size), packed(hidden_size, inter)
    w13_bias = torch.randn(experts, 2 * inter, device="cuda", generator=generator).to(torch.bfloat16) * 0.1
    w2_bias = torch.randn(experts, hidden_size, device="cuda", generator=generator).to(torch.bfloat16) * 0.1
    hidden = torch.randn(num_tokens, hidden_size, device="cuda", generator=generator).to(torch.bfloat16)
    weights, ids = route(torch.randn(num_tokens, experts, device="cuda", generator=generator), top_k)
    out = fused_experts(hidden, w13, w2, weights, ids, CLAMPED, w13_bias, w2_bias)
    expected = fused_experts(hidden, w13.dequantize(torch.bfloat16), w2.dequantize(torch.bfloat16), weights, ids,
                             CLAMPED, w13_bias, w2_bias)
    _assert_close_bf16(out, expected)
