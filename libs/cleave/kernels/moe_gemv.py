"""Experts for a handful of tokens: one weight-streaming GEMV per (token, expert) entry.

At decode batch sizes a MoE layer reads each chosen expert's weights once and multiplies
them by one or a few rows, so its time is the touched experts' bytes over HBM bandwidth.
`fused_moe`'s grouped GEMMs need the entries sorted and padded by expert first (three
alignment launches and a fill), pad every expert's one row to a 16-row tile, and launch a
grid sized for the worst case; at one token that is most of the layer's time. Here there
is no alignment at all:

1. `gate_up`: a program per (entry, BLOCK_N intermediate features) reads its entry's
   expert id, streams that expert's gate and up rows into registers (the next K tile in
   flight while the current one is reduced, as `cleave.kernels.gemv`) against the token's
   hidden row, adds the bias and applies the gated activation -> intermediate [T*k, I],
   rounded to the activation dtype (as the grouped kernel stores it).
2. `down`: a program per (token, BLOCK_N hidden features) walks the token's k entries,
   each a GEMV of that expert's down rows against the entry's intermediate row (+ bias),
   scaled by the routing weight and summed in fp32 -> [T, H], rounded once. No [T*k, H]
   fp32 buffer, no separate sum, and the order of the sum is fixed (deterministic).

Two launches after routing, none of which reads a value back to the host: the layer stays
inside a decode CUDA graph. Two tokens sharing an expert read its weights twice (from L2
at these sizes), which is why `fused_experts` sends only up to `MAX_TOKENS` tokens here.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from cleave.kernels.dispatch import CachedLauncher
from cleave.kernels.moe_reference import MoEActivation
from cleave.kernels.mxfp4 import MXFP4Weight, decode_e2m1, e8m0_scale, weight_launch_args

MAX_TOKENS = 4  # tokens `fused_experts` sends here by default; more go to the grouped GEMMs
TILE_ELEMENTS = 8192  # weight elements per program per K tile (features x K), per half when gated


@triton.jit
def gated_activation(gate, up, alpha, limit, CLAMPED: tl.constexpr):
    """An expert's activation of its gate and up products in fp32 (`MoEActivation`):
    silu(gate) * up, or gpt-oss's clamped (up + 1) * gate * sigmoid(alpha * gate)."""
    if CLAMPED:
        gate = tl.minimum(gate, limit)
        up = tl.minimum(tl.maximum(up, -limit), limit)
        return (up + 1.0) * gate * tl.sigmoid(gate * alpha)
    return gate * tl.sigmoid(gate) * up


@triton.jit
def _weight_tile(rows, scale_rows, t, row_valid, num_in, BLOCK_K: tl.constexpr, MXFP4: tl.constexpr):
    """K tile `t` of the weight rows starting at `rows` [BN]: [BN, BLOCK_K] values, or with
    MXFP4 [BN, BLOCK_K // 2] packed bytes and [BN, BLOCK_K // 32] scale codes (from the rows
    at `scale_rows`; the second value is unused otherwise)."""
    if MXFP4:
        packed = t * (BLOCK_K // 2) + tl.arange(0, BLOCK_K // 2)
        w = tl.load(rows[:, None] + packed[None, :], mask=row_valid[:, None] & (packed < num_in // 2)[None, :], other=0)
        groups = t * (BLOCK_K // 32) + tl.arange(0, BLOCK_K // 32)
        scales = tl.load(scale_rows[:, None] + groups[None, :],
                         mask=row_valid[:, None] & (groups < num_in // 32)[None, :], other=0)
    else:
        cols = t * BLOCK_K + tl.arange(0, BLOCK_K)
        w = tl.load(rows[:, None] + cols[None, :], mask=row_valid[:, None] & (cols < num_in)[None, :], other=0.0)
        scales = w
    return w, scales


@triton.jit
def _tile_dot(x, w, scales, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, MXFP4: tl.constexpr):
    """[BN] fp32: each row of a weight tile (`_weight_tile`) times x [BLOCK_K] fp32. MXFP4
    rows are decoded in registers: each byte's low nibble meets x's even element and its
    high nibble the odd one; each 32-value group's sum is scaled once."""
    if MXFP4:
        x_even, x_odd = tl.split(tl.reshape(x, [BLOCK_K // 2, 2]))
        codes = w.to(tl.int32)
        products = decode_e2m1(codes & 15) * x_even[None, :] + decode_e2m1(codes >> 4) * x_odd[None, :]
        group_sums = tl.sum(tl.reshape(products, [BLOCK_N, BLOCK_K // 32, 16]), axis=2)
        dots = tl.sum(group_sums * e8m0_scale(scales.to(tl.int32)), axis=1)
    else:
        dots = tl.sum(x[None, :] * w.to(tl.float32), axis=1)
    return dots


@triton.jit
def _gate_up_kernel(
    x_ptr,  # [T, K] (NORM: the residual stream)
    w_ptr,  # [E, 2N, K]: gate rows then up rows (MXFP4: [E, 2N, K // 2] bytes)
    scale_ptr,  # MXFP4: [E, 2N, K // 32] scale codes
    bias_ptr,  # [E, 2N] when HAS_BIAS
    norm_w_ptr,  # [K] RMSNorm weight when NORM
    ids_ptr,  # [T * TOP_K] int32 expert ids
    out_ptr,  # [T * TOP_K, N]
    num_out,  # N (intermediate features)
    num_in,  # K (hidden)
    stride_x,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    stride_bias,
    stride_out,
    alpha,
    limit,
    eps,
    TOP_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    K_TILES: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    CLAMPED: tl.constexpr,
    NORM: tl.constexpr,
    MXFP4: tl.constexpr,
):
    entry = tl.program_id(0).to(tl.int64)
    token = entry // TOP_K
    expert = tl.load(ids_ptr + entry).to(tl.int64)
    features = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    feature_valid = features < num_out
    cols = tl.arange(0, BLOCK_K)
    rows = w_ptr + expert * stride_we + features.to(tl.int64) * stride_wn  # [BN] gate rows
    scale_rows = scale_ptr + expert * stride_se + features.to(tl.int64) * stride_sn
    up_rows = rows + num_out.to(tl.int64) * stride_wn
    up_scale_rows = scale_rows + num_out.to(tl.int64) * stride_sn
    x_row = x_ptr + token * stride_x + cols

    w, scales = _weight_tile(rows, scale_rows, 0, feature_valid, num_in, BLOCK_K, MXFP4)
    w_up, scales_up = _weight_tile(up_rows, up_scale_rows, 0, feature_valid, num_in, BLOCK_K, MXFP4)
    if NORM:  # the token's row is RMS-normalised on the fly (a few KiB, against MiBs of weights)
        squares = tl.zeros([BLOCK_K], dtype=tl.float32)
        for t in tl.static_range(K_TILES):
            x = tl.load(x_row + t * BLOCK_K, mask=t * BLOCK_K + cols < num_in, other=0.0).to(tl.float32)
            squares += x * x
        rstd = tl.math.rsqrt(tl.sum(squares, axis=0) / num_in + eps)
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_N], dtype=tl.float32)
    for t in tl.static_range(K_TILES):
        next_w, next_scales = w, scales
        next_w_up, next_scales_up = w_up, scales_up
        if t + 1 < K_TILES:  # the next tile's loads go out before this one is reduced
            next_w, next_scales = _weight_tile(rows, scale_rows, t + 1, feature_valid, num_in, BLOCK_K, MXFP4)
            next_w_up, next_scales_up = _weight_tile(up_rows, up_scale_rows, t + 1, feature_valid, num_in, BLOCK_K,
                                                     MXFP4)
        col_valid = t * BLOCK_K + cols < num_in
        x = tl.load(x_row + t * BLOCK_K, mask=col_valid, other=0.0)
        if NORM:  # rounded as the unfused RMSNorm's output: normalised, then scaled by the weight
            norm_w = tl.load(norm_w_ptr + t * BLOCK_K + cols, mask=col_valid, other=0.0).to(tl.float32)
            normed = (x.to(tl.float32) * rstd).to(x.dtype).to(tl.float32)
            x = (normed * norm_w).to(x.dtype)
        x = x.to(tl.float32)
        acc += _tile_dot(x, w, scales, BLOCK_N, BLOCK_K, MXFP4)
        acc_up += _tile_dot(x, w_up, scales_up, BLOCK_N, BLOCK_K, MXFP4)
        w, scales = next_w, next_scales
        w_up, scales_up = next_w_up, next_scales_up
    if HAS_BIAS:
        bias_row = bias_ptr + expert * stride_bias
        acc += tl.load(bias_row + features, mask=feature_valid, other=0.0).to(tl.float32)
        acc_up += tl.load(bias_row + num_out + features, mask=feature_valid, other=0.0).to(tl.float32)
    act = gated_activation(acc, acc_up, alpha, limit, CLAMPED)
    tl.store(out_ptr + entry * stride_out + features, act.to(out_ptr.dtype.element_ty), mask=feature_valid)


@triton.jit
def _down_sum_kernel(
    inter_ptr,  # [T * TOP_K, K]
    w_ptr,  # [E, N, K] (MXFP4: [E, N, K // 2] bytes)
    scale_ptr,  # MXFP4: [E, N, K // 32] scale codes
    bias_ptr,  # [E, N] when HAS_BIAS
    ids_ptr,  # [T * TOP_K] int32
    weights_ptr,  # [T * TOP_K] fp32 routing weights
    out_ptr,  # [T, N]; ADD: the residual stream, updated in place
    num_out,  # N (hidden)
    num_in,  # K (intermediate)
    stride_inter,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    stride_bias,
    stride_out,
    TOP_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    K_TILES: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    ADD: tl.constexpr,
    MXFP4: tl.constexpr,
):
    # One pass over the token's k entries x K tiles; each step's weight tile is loaded while
    # the step before it is reduced, across entries too (one tile per entry at I <= 2048).
    token = tl.program_id(0).to(tl.int64)
    features = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    feature_valid = features < num_out
    cols = tl.arange(0, BLOCK_K)
    row_offsets = features.to(tl.int64) * stride_wn
    scale_offsets = features.to(tl.int64) * stride_sn
    expert = tl.load(ids_ptr + token * TOP_K).to(tl.int64)
    w, scales = _weight_tile(w_ptr + expert * stride_we + row_offsets, scale_ptr + expert * stride_se + scale_offsets,
                             0, feature_valid, num_in, BLOCK_K, MXFP4)
    total = tl.zeros([BLOCK_N], dtype=tl.float32)
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for step in tl.static_range(TOP_K * K_TILES):
        slot = step // K_TILES
        t = step % K_TILES
        next_w, next_scales = w, scales
        next_expert = expert
        if step + 1 < TOP_K * K_TILES:
            next_t = (step + 1) % K_TILES
            if next_t == 0:
                next_expert = tl.load(ids_ptr + token * TOP_K + slot + 1).to(tl.int64)
            next_w, next_scales = _weight_tile(
                w_ptr + next_expert * stride_we + row_offsets, scale_ptr + next_expert * stride_se + scale_offsets,
                next_t, feature_valid, num_in, BLOCK_K, MXFP4,
            )
        entry = token * TOP_K + slot
        x = tl.load(inter_ptr + entry * stride_inter + t * BLOCK_K + cols,
                    mask=t * BLOCK_K + cols < num_in, other=0.0).to(tl.float32)
        acc += _tile_dot(x, w, scales, BLOCK_N, BLOCK_K, MXFP4)
        if t == K_TILES - 1:  # the entry is done: its bias, its routing weight, into the sum
            if HAS_BIAS:
                acc += tl.load(bias_ptr + expert * stride_bias + features, mask=feature_valid, other=0.0).to(tl.float32)
            total += acc * tl.load(weights_ptr + entry)
            acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        w, scales = next_w, next_scales
        expert = next_expert
    out_ptrs = out_ptr + token * stride_out + features
    result = total.to(out_ptr.dtype.element_ty)  # the layer's output, rounded once
    if ADD:  # then added into the residual stream, as the next layer's fused add would
        residual = tl.load(out_ptrs, mask=feature_valid, other=0.0)
        result = (residual.to(tl.float32) + result.to(tl.float32)).to(out_ptr.dtype.element_ty)
    tl.store(out_ptrs, result, mask=feature_valid)


def gemv_tiles(num_out: int, num_in: int, gated: bool) -> tuple[int, int, int]:
    """(block_n, block_k, num_warps): rows up to 2048 wide are one K tile; each program
    owns few features (many small programs: every SM streams), fewer again when gated
    (two weight rows per feature)."""
    block_k = min(triton.next_power_of_2(num_in), 2048)
    block_n = max(1, TILE_ELEMENTS // block_k // (2 if gated else 1))
    return min(block_n, triton.next_power_of_2(num_out)), block_k, 4


Tiles = tuple[int, int, int]  # (block_n, block_k, num_warps)
_gate_up_launcher = CachedLauncher(_gate_up_kernel)
_down_sum_launcher = CachedLauncher(_down_sum_kernel)


def moe_gemv(
    hidden: torch.Tensor,  # [T, H]
    w13: torch.Tensor | MXFP4Weight,  # [E, 2I, H]
    w2: torch.Tensor | MXFP4Weight,  # [E, H, I]
    topk_weights: torch.Tensor,  # [T, k] fp32
    topk_ids: torch.Tensor,  # [T, k] int32
    activation: MoEActivation,
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
    gate_up_tiles: Tiles | None = None,  # default: gemv_tiles (bench/moe.py --gemv-tiles sweeps them)
    down_tiles: Tiles | None = None,
    *,
    norm_weight: torch.Tensor | None = None,  # [H]: `hidden` is the residual stream, RMS-normalised first
    eps: float = 1e-6,
    add_to: torch.Tensor | None = None,  # [T, H]: add the layer's output into it in place
) -> torch.Tensor:  # [T, H]; `add_to` itself when given
    """sum_k topk_weights[t, k] * expert_{topk_ids[t, k]}(hidden[t]) by per-entry GEMVs
    (see the module doc); the caller has checked the layouts (`fused_experts`). With
    `norm_weight` the experts read rms_norm(hidden) (the layer's input norm in the first
    kernel's prologue); with `add_to` (may be `hidden` itself: the first kernel has read it
    by then) the output is added into it, each rounded as the unfused ops round. MXFP4
    weights (`cleave.kernels.mxfp4`) are read packed and decoded in registers."""
    num_tokens, hidden_size = hidden.shape
    top_k = topk_ids.shape[1]
    inter = w13.shape[1] // 2
    if add_to is None:
        out = torch.empty(num_tokens, hidden_size, dtype=hidden.dtype, device=hidden.device)
    elif add_to.shape != hidden.shape or add_to.stride(-1) != 1 or add_to.dtype != hidden.dtype:
        raise ValueError(f"add_to must be [{num_tokens}, {hidden_size}] {hidden.dtype}, contiguous along features, "
                         f"got {tuple(add_to.shape)} {add_to.dtype}")
    else:
        out = add_to
    if num_tokens == 0:
        return out
    ids = topk_ids.reshape(-1)
    intermediate = torch.empty(num_tokens * top_k, inter, dtype=hidden.dtype, device=hidden.device)
    weights, scales, stride_we, stride_wn, stride_se, stride_sn = weight_launch_args(w13)
    block_n, block_k, warps = gate_up_tiles or gemv_tiles(inter, hidden_size, gated=True)
    _gate_up_launcher(
        (num_tokens * top_k, triton.cdiv(inter, block_n)),
        (hidden, weights, scales, w13_bias if w13_bias is not None else hidden,
         norm_weight if norm_weight is not None else hidden,
         ids, intermediate, inter, hidden_size, hidden.stride(0), stride_we, stride_wn, stride_se, stride_sn,
         w13_bias.stride(0) if w13_bias is not None else 0, intermediate.stride(0),
         activation.alpha, activation.limit, eps),
        (top_k, block_n, block_k, triton.cdiv(hidden_size, block_k), w13_bias is not None,
         activation.kind == "swiglu_clamped", norm_weight is not None, isinstance(w13, MXFP4Weight)),
        warps,
    )
    weights, scales, stride_we, stride_wn, stride_se, stride_sn = weight_launch_args(w2)
    block_n, block_k, warps = down_tiles or gemv_tiles(hidden_size, inter, gated=False)
    _down_sum_launcher(
        (num_tokens, triton.cdiv(hidden_size, block_n)),
        (intermediate, weights, scales, w2_bias if w2_bias is not None else hidden, ids,
         topk_weights.reshape(-1).to(torch.float32), out, hidden_size, inter, intermediate.stride(0),
         stride_we, stride_wn, stride_se, stride_sn, w2_bias.stride(0) if w2_bias is not None else 0, out.stride(0)),
        (top_k, block_n, block_k, triton.cdiv(inter, block_k), w2_bias is not None, add_to is not None,
         isinstance(w2, MXFP4Weight)),
        warps,
    )
    return out
