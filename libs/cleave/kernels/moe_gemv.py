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
   rounded to the activation dtype (as the grouped kernel stores it). Given the router
   logits instead of the routing, each program first routes its token itself
   (`moe_routing.top_k_routing`, the arithmetic and tie-break of `fused_moe.route`) and takes
   its slot's expert; the programs of feature block 0 write each entry's id and weight for
   the next kernel. Every program repeats the token's top-k (E logits from L2, k rounds of
   reductions): redundant work instead of a routing launch or a sync between programs.
2. `down`: a program per (token, BLOCK_N hidden features) walks the token's k entries,
   each a GEMV of that expert's down rows against the entry's intermediate row (+ bias),
   scaled by the routing weight and summed in fp32 -> [T, H], rounded once. No [T*k, H]
   fp32 buffer, no separate sum, and the order of the sum is fixed (deterministic). The
   token's k expert ids, weights and residual row are read up front, so the walk's weight
   tiles never wait on an id, and one or two tiles are in flight ahead of the one reduced
   (`down_depth_for`). A program per (entry, feature block) instead, the last of a token's k
   summing their products, was slower on the H200 (the Qwen3-30B-A3B-shaped step at batch 1:
   2852 vs 2662 us, bench/results/moe/moe-decode-20261206T030643Z.md) and was removed.

With programmatic dependent launch (`pdl`, the decode layout's) the routing kernel and the
first expert kernel wait on their producer before they let the next kernel in, so the down
kernel, when the routing was given, reads it and streams its first weight tiles before its
own wait, while the gate_up kernel still runs.

Two launches after the router's GEMV (routing inside the first; three with a separate
`route`), none of which reads a value back to the host: the layer stays inside a decode
CUDA graph. Two tokens sharing an expert read its weights twice (from L2 at these sizes),
which is why `fused_experts` sends only up to `MAX_TOKENS` tokens here.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from cleave.kernels.dispatch import CachedLauncher
from cleave.kernels.moe_reference import MoEActivation
from cleave.kernels.moe_routing import routing_blocks, top_k_routing
from cleave.kernels.mxfp4 import MXFP4Weight, decode_e2m1, e8m0_scale, weight_launch_args
from cleave.kernels.pdl import launch_options, pdl_enabled, release_dependents, wait_for_producer

MAX_TOKENS = 4  # tokens `fused_experts` sends here by default; more go to the grouped GEMMs
TILE_ELEMENTS = 8192  # weight elements per program per K tile (features x K), per half when gated
# Down-projection weight tiles each program has in flight beyond the one it reduces. A
# program walks its token's k entries one after another (Qwen3-30B-A3B: 8 steps of an
# 8 x 768 tile), so at one step ahead its time is k round trips to HBM; two ahead shorten
# that chain for one more tile of registers. That pays while there are few programs: the
# Qwen3-30B-A3B-shaped layer at 1 / 2 / 4 tokens, two vs one ahead, took 44.4 / 67.3 / 103.4
# vs 46.3 / 68.7 / 98.1 us on an H200 (bench/results/moe/moe-layer-20261205T214643Z.md; on an
# H100 52.2 / 80.2 / 122.7 vs 54.0 / 81.2 / 118.2 us, moe-layer-20261205T212951Z.md).
DEEP_DOWN_MAX_TOKENS = 2


def down_depth_for(num_tokens: int) -> int:
    """The down GEMV's tiles in flight ahead for `num_tokens` tokens (see DEEP_DOWN_MAX_TOKENS)."""
    return 2 if num_tokens <= DEEP_DOWN_MAX_TOKENS else 1


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
def _routed_expert(logits_row_ptr, ids_ptr, out_weights_ptr, entry, num_experts, TOP_K: tl.constexpr,
                   BLOCK_TOPK: tl.constexpr, BLOCK_E: tl.constexpr, RENORMALIZE: tl.constexpr):
    """The expert (int64) of `entry` (token * TOP_K + slot) from its token's router logits.
    Every program of the entry routes the token (E logits from L2, TOP_K rounds: no launch
    and no sync between programs); the one with feature block 0 writes the entry's id and
    weight, which the down kernel (the next launch) reads as it reads given routing."""
    weights, ids = top_k_routing(logits_row_ptr, num_experts, TOP_K, BLOCK_TOPK, BLOCK_E, RENORMALIZE)
    picked = tl.arange(0, BLOCK_TOPK) == entry % TOP_K
    expert = tl.sum(tl.where(picked, ids, 0), axis=0)
    if tl.program_id(1) == 0:
        tl.store(ids_ptr + entry, expert)
        tl.store(out_weights_ptr + entry, tl.sum(tl.where(picked, weights, 0.0), axis=0))
    return expert.to(tl.int64)


@triton.jit
def _gate_up_kernel(
    x_ptr,  # [T, K] (NORM: the residual stream)
    w_ptr,  # [E, 2N, K]: gate rows then up rows (MXFP4: [E, 2N, K // 2] bytes)
    scale_ptr,  # MXFP4: [E, 2N, K // 32] scale codes
    bias_ptr,  # [E, 2N] when HAS_BIAS
    norm_w_ptr,  # [K] RMSNorm weight when NORM
    logits_ptr,  # [T, E] router logits when ROUTE
    ids_ptr,  # [T * TOP_K] int32 expert ids (ROUTE: written here)
    out_weights_ptr,  # [T * TOP_K] fp32 routing weights, written when ROUTE
    out_ptr,  # [T * TOP_K, N]
    num_out,  # N (intermediate features)
    num_in,  # K (hidden)
    num_experts,  # E when ROUTE
    stride_x,
    stride_logits,
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
    ROUTE: tl.constexpr,  # route the token here (`top_k_routing`) instead of reading ids_ptr
    BLOCK_TOPK: tl.constexpr,  # ROUTE: next power of two >= TOP_K
    BLOCK_E: tl.constexpr,  # ROUTE: next power of two >= E
    RENORMALIZE: tl.constexpr,
    PDL: tl.constexpr,
):
    # Everything this kernel reads but the norm's weight may come from the launch before it
    # (the routing, or the router's logits and the residual stream): it waits first, then
    # lets the down kernel's programs in, which find the routing complete
    # (`_down_sum_kernel`'s EARLY). The norm weight's first tile goes out before the wait,
    # not after the row's rsqrt.
    cols = tl.arange(0, BLOCK_K)
    norm_w_first = tl.zeros([BLOCK_K], dtype=x_ptr.dtype.element_ty)
    if NORM:
        norm_w_first = tl.load(norm_w_ptr + cols, mask=cols < num_in, other=0.0)
    wait_for_producer(PDL)
    release_dependents(PDL)
    entry = tl.program_id(0).to(tl.int64)
    token = entry // TOP_K
    if ROUTE:
        expert = _routed_expert(logits_ptr + token * stride_logits, ids_ptr, out_weights_ptr, entry, num_experts,
                                TOP_K, BLOCK_TOPK, BLOCK_E, RENORMALIZE)
    else:
        expert = tl.load(ids_ptr + entry).to(tl.int64)
    features = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    feature_valid = features < num_out
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
            norm_w = norm_w_first.to(tl.float32)
            if t > 0:
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
def _slot_value(values, slots, slot):
    """values[slot] of a [BLOCK_TOPK] vector held in registers (a masked sum: no memory)."""
    return tl.sum(tl.where(slots == slot, values, 0), axis=0)


@triton.jit
def _step_tile(w_experts, s_experts, experts, slots, step, stride_we, stride_se, feature_valid, num_in,
               K_TILES: tl.constexpr, BLOCK_K: tl.constexpr, MXFP4: tl.constexpr):
    """The down walk's weight tile of `step` (entry step // K_TILES, K tile step % K_TILES):
    `_weight_tile` of that entry's expert, read from the ids in registers."""
    expert = _slot_value(experts, slots, step // K_TILES)
    return _weight_tile(w_experts + expert * stride_we, s_experts + expert * stride_se, step % K_TILES, feature_valid,
                        num_in, BLOCK_K, MXFP4)


@triton.jit
def _step_inputs(inter_rows, step, cols, num_in, stride_inter, K_TILES: tl.constexpr, BLOCK_K: tl.constexpr):
    """The down walk's input of `step`: K tile step % K_TILES of entry step // K_TILES's
    intermediate row ([BLOCK_K] in its stored dtype; `inter_rows` points at the token's first
    entry's row)."""
    t = step % K_TILES
    row = inter_rows + (step // K_TILES) * stride_inter + t * BLOCK_K
    return tl.load(row + cols, mask=t * BLOCK_K + cols < num_in, other=0.0)


@triton.jit
def _store_sum(total, residual, out_ptrs, feature_valid, ADD: tl.constexpr):
    """Store a token's weighted expert sum (fp32 [BLOCK_N]) rounded once to the output dtype;
    with ADD added into the residual row it holds, as the next layer's fused add would."""
    dtype = out_ptrs.dtype.element_ty
    result = total.to(dtype)
    if ADD:
        result = (residual.to(tl.float32) + result.to(tl.float32)).to(dtype)
    tl.store(out_ptrs, result, mask=feature_valid)


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
    BLOCK_TOPK: tl.constexpr,  # next power of two >= TOP_K
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    K_TILES: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    ADD: tl.constexpr,
    MXFP4: tl.constexpr,
    DEPTH: tl.constexpr,  # weight tiles in flight beyond the one being reduced: 1 or 2
    PDL: tl.constexpr,
    EARLY: tl.constexpr,  # PDL with routing the first kernel did not write: read it before the wait
):
    # One pass over the token's k entries x K tiles (one tile per entry at I <= 2048). The
    # token's expert ids, routing weights and residual row are loaded first, in one round
    # trip, so no weight load waits on an id load; each step's weight tile then goes out
    # DEPTH steps before it is reduced, across entries too: the k entries are a chain of
    # dependent steps, and with DEPTH tiles in flight it is that many times shorter. Each
    # step's slice of the intermediate rows (written by the gate/up kernel, so read after
    # the wait) goes out with its weight tile: loaded at the step that reduces it, its L2
    # round trip stood before every step's reduction (sm_90 code for Qwen3-30B-A3B's shape).
    # Entries of one bf16 / fp16 K tile (Qwen3-30B-A3B's): each step adds its tile's products,
    # scaled by the entry's routing weight, into one [BLOCK_N, BLOCK_K] fp32 accumulator,
    # reduced across the program once after the walk. The sm_90 code of that shape had two
    # barriers and 65 shuffles in every step (17 and 520 in all), now 3 and 128, for 255
    # registers instead of 128 (still two programs an SM; step 2797 -> 2650 us on an H100 with
    # the load-order changes, 2796 -> 2697 without, bench/results/moe/ab/ab-20261206T141833Z.md,
    # ...141921Z.md). Entries of two K tiles (gpt-oss-20b's bf16 experts: 720 programs) went
    # from 144 to 255 registers that way, three programs an SM to two; a tree that also summed
    # the register GEMV's tiles once made gpt-oss-20b's step slower (3008 -> 3179 us,
    # ab-20261206T142138Z.md; the parts not timed apart), so they keep a reduction a step, as
    # MXFP4 tiles do (each 32-value group is summed before its scale).
    token = tl.program_id(0).to(tl.int64)
    features = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    feature_valid = features < num_out
    cols = tl.arange(0, BLOCK_K)
    row_offsets = features.to(tl.int64) * stride_wn
    scale_offsets = features.to(tl.int64) * stride_sn
    slots = tl.arange(0, BLOCK_TOPK)
    slot_valid = slots < TOP_K
    if not EARLY:
        wait_for_producer(PDL)
    experts = tl.load(ids_ptr + token * TOP_K + slots, mask=slot_valid, other=0).to(tl.int64)  # [BLOCK_TOPK]
    entry_weights = tl.load(weights_ptr + token * TOP_K + slots, mask=slot_valid, other=0.0)
    out_ptrs = out_ptr + token * stride_out + features
    residual = tl.zeros([BLOCK_N], dtype=out_ptr.dtype.element_ty)
    if ADD:
        residual = tl.load(out_ptrs, mask=feature_valid, other=0.0)
    w_experts = w_ptr + row_offsets
    s_experts = scale_ptr + scale_offsets
    steps: tl.constexpr = TOP_K * K_TILES

    w, scales = _step_tile(w_experts, s_experts, experts, slots, 0, stride_we, stride_se, feature_valid, num_in,
                           K_TILES, BLOCK_K, MXFP4)
    w2, scales2 = w, scales  # DEPTH 2: the tile after `w`
    if DEPTH == 2 and steps > 1:
        w2, scales2 = _step_tile(w_experts, s_experts, experts, slots, 1, stride_we, stride_se, feature_valid, num_in,
                                 K_TILES, BLOCK_K, MXFP4)
    if EARLY:
        wait_for_producer(PDL)
    release_dependents(PDL)
    inter_rows = inter_ptr + token * TOP_K * stride_inter
    x = _step_inputs(inter_rows, 0, cols, num_in, stride_inter, K_TILES, BLOCK_K)
    x2 = x  # DEPTH 2: the input after `x`
    if DEPTH == 2 and steps > 1:
        x2 = _step_inputs(inter_rows, 1, cols, num_in, stride_inter, K_TILES, BLOCK_K)
    total = tl.zeros([BLOCK_N], dtype=tl.float32)
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    products = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)  # one bf16 K tile: reduced once, after the walk
    for step in tl.static_range(steps):
        slot = step // K_TILES
        t = step % K_TILES
        ahead_w, ahead_scales, ahead_x = w, scales, x
        if step + DEPTH < steps:
            ahead_w, ahead_scales = _step_tile(w_experts, s_experts, experts, slots, step + DEPTH, stride_we, stride_se,
                                               feature_valid, num_in, K_TILES, BLOCK_K, MXFP4)
            ahead_x = _step_inputs(inter_rows, step + DEPTH, cols, num_in, stride_inter, K_TILES, BLOCK_K)
        if MXFP4 or K_TILES > 1:
            acc += _tile_dot(x.to(tl.float32), w, scales, BLOCK_N, BLOCK_K, MXFP4)
        else:
            products += w.to(tl.float32) * (x.to(tl.float32) * _slot_value(entry_weights, slots, slot))[None, :]
        # The entry is done: its bias, its routing weight, into the sum (nothing to add on the
        # single-reduction path without a bias: its products were scaled as they went in).
        if t == K_TILES - 1 and (MXFP4 or K_TILES > 1 or HAS_BIAS):
            if HAS_BIAS:
                expert = _slot_value(experts, slots, slot)
                acc += tl.load(bias_ptr + expert * stride_bias + features, mask=feature_valid, other=0.0).to(tl.float32)
            total += acc * _slot_value(entry_weights, slots, slot)
            acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        if DEPTH == 2:
            w, scales, x = w2, scales2, x2
            w2, scales2, x2 = ahead_w, ahead_scales, ahead_x
        else:
            w, scales, x = ahead_w, ahead_scales, ahead_x
    if not MXFP4 and K_TILES == 1:
        total += tl.sum(products, axis=1)
    _store_sum(total, residual, out_ptrs, feature_valid, ADD)


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
    topk_weights: torch.Tensor | None,  # [T, k] fp32; None with `router_logits`
    topk_ids: torch.Tensor | None,  # [T, k] int32; None with `router_logits`
    activation: MoEActivation,
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
    gate_up_tiles: Tiles | None = None,  # default: gemv_tiles (bench/moe.py --gemv-tiles sweeps them)
    down_tiles: Tiles | None = None,
    *,
    norm_weight: torch.Tensor | None = None,  # [H]: `hidden` is the residual stream, RMS-normalised first
    eps: float = 1e-6,
    add_to: torch.Tensor | None = None,  # [T, H]: add the layer's output into it in place
    router_logits: torch.Tensor | None = None,  # [T, E]: route inside the first kernel instead
    top_k: int | None = None,  # with `router_logits`
    renormalize: bool = True,  # with `router_logits`
    routing_out: tuple[torch.Tensor, torch.Tensor] | None = None,  # with `router_logits`: ([T, k] fp32, [T, k] int32)
    down_depth: int | None = None,  # down weight tiles in flight beyond the one reduced (1, 2; None: down_depth_for)
    pdl: bool = False,
) -> torch.Tensor:  # [T, H]; `add_to` itself when given
    """sum_k topk_weights[t, k] * expert_{topk_ids[t, k]}(hidden[t]) by per-entry GEMVs
    (see the module doc); the caller has checked the layouts (`fused_experts`). With
    `norm_weight` the experts read rms_norm(hidden) (the layer's input norm in the first
    kernel's prologue); with `add_to` (may be `hidden` itself: the first kernel has read it
    by then) the output is added into it, each rounded as the unfused ops round. MXFP4
    weights (`cleave.kernels.mxfp4`) are read packed and decoded in registers.

    Given `router_logits` and `top_k` instead of the routing, the first kernel routes each
    token itself (exactly as `fused_moe.route`: one launch fewer) and writes the routing to
    `routing_out` when given (else to scratch), where the second kernel reads it."""
    num_tokens, hidden_size = hidden.shape
    inter = w13.shape[1] // 2
    if down_depth is None:
        down_depth = down_depth_for(num_tokens)
    elif down_depth not in (1, 2):
        raise ValueError(f"down_depth must be 1 or 2, got {down_depth}")
    if add_to is None:
        out = torch.empty(num_tokens, hidden_size, dtype=hidden.dtype, device=hidden.device)
    elif add_to.shape != hidden.shape or add_to.stride(-1) != 1 or add_to.dtype != hidden.dtype:
        raise ValueError(f"add_to must be [{num_tokens}, {hidden_size}] {hidden.dtype}, contiguous along features, "
                         f"got {tuple(add_to.shape)} {add_to.dtype}")
    else:
        out = add_to
    routing = _routing(hidden, w13.shape[0], topk_weights, topk_ids, router_logits, top_k, renormalize, routing_out)
    if num_tokens == 0:
        return out
    top_k = routing.top_k
    intermediate = torch.empty(num_tokens * top_k, inter, dtype=hidden.dtype, device=hidden.device)
    pdl = pdl_enabled(hidden, pdl)
    launch = launch_options(pdl)
    weights, scales, stride_we, stride_wn, stride_se, stride_sn = weight_launch_args(w13)
    block_n, block_k, warps = gate_up_tiles or gemv_tiles(inter, hidden_size, gated=True)
    logits = routing.logits if routing.logits is not None else hidden
    _gate_up_launcher(
        (num_tokens * top_k, triton.cdiv(inter, block_n)),
        (hidden, weights, scales, w13_bias if w13_bias is not None else hidden,
         norm_weight if norm_weight is not None else hidden, logits, routing.ids, routing.weights,
         intermediate, inter, hidden_size, routing.num_experts, hidden.stride(0), logits.stride(0), stride_we,
         stride_wn, stride_se, stride_sn, w13_bias.stride(0) if w13_bias is not None else 0, intermediate.stride(0),
         activation.alpha, activation.limit, eps),
        (top_k, block_n, block_k, triton.cdiv(hidden_size, block_k), w13_bias is not None,
         activation.kind == "swiglu_clamped", norm_weight is not None, isinstance(w13, MXFP4Weight),
         *routing.constexprs, pdl),
        warps, **launch,
    )
    weights, scales, stride_we, stride_wn, stride_se, stride_sn = weight_launch_args(w2)
    block_n, block_k, warps = down_tiles or gemv_tiles(hidden_size, inter, gated=False)
    num_blocks = triton.cdiv(hidden_size, block_n)
    bias = w2_bias if w2_bias is not None else hidden
    strides = (stride_we, stride_wn, stride_se, stride_sn, w2_bias.stride(0) if w2_bias is not None else 0,
               out.stride(0))
    # With PDL the first kernel waits before it lets this one in, so routing it did not write
    # is complete when this one starts: its reads (and the weights they pick) go before the wait.
    early = pdl and routing.logits is None
    _down_sum_launcher(
        (num_tokens, num_blocks),
        (intermediate, weights, scales, bias, routing.ids, routing.weights, out, hidden_size, inter,
         intermediate.stride(0), *strides),
        (top_k, triton.next_power_of_2(top_k), block_n, block_k, triton.cdiv(inter, block_k), w2_bias is not None,
         add_to is not None, isinstance(w2, MXFP4Weight), down_depth, pdl, early),
        warps, **launch,
    )
    return out


@dataclass(frozen=True)
class _Routing:
    """The routing buffers the kernels read: `weights` [T*k] fp32 and `ids` [T*k] int32,
    given or (with `logits` [T, E]) written by the first kernel, and that kernel's routing
    constexprs (ROUTE, BLOCK_TOPK, BLOCK_E, RENORMALIZE)."""

    weights: torch.Tensor
    ids: torch.Tensor
    top_k: int
    logits: torch.Tensor | None
    num_experts: int
    constexprs: tuple[bool, int, int, bool] = (False, 1, 1, False)


def _routing(
    hidden: torch.Tensor,
    num_experts: int,
    topk_weights: torch.Tensor | None,
    topk_ids: torch.Tensor | None,
    router_logits: torch.Tensor | None,
    top_k: int | None,
    renormalize: bool,
    routing_out: tuple[torch.Tensor, torch.Tensor] | None,
) -> _Routing:
    """`moe_gemv`'s routing arguments checked and laid out for its kernels: either the
    routing (weights and ids) or the router logits with top_k (and optional output buffers)."""
    num_tokens = hidden.shape[0]
    if router_logits is None:
        if topk_weights is None or topk_ids is None or top_k is not None or routing_out is not None:
            raise ValueError("moe_gemv takes topk_weights and topk_ids, or router_logits and top_k")
        return _Routing(topk_weights.reshape(-1).to(torch.float32), topk_ids.reshape(-1), topk_ids.shape[1], None,
                        num_experts)
    if topk_weights is not None or topk_ids is not None or top_k is None:
        raise ValueError("moe_gemv takes topk_weights and topk_ids, or router_logits and top_k")
    if router_logits.shape != (num_tokens, num_experts):
        raise ValueError(f"router_logits must be [{num_tokens}, {num_experts}], got {tuple(router_logits.shape)}")
    block_topk, block_e = routing_blocks(num_experts, top_k)  # checks top_k
    logits = router_logits if router_logits.stride(-1) == 1 else router_logits.contiguous()
    if routing_out is None:
        routing_out = (torch.empty(num_tokens, top_k, dtype=torch.float32, device=hidden.device),
                       torch.empty(num_tokens, top_k, dtype=torch.int32, device=hidden.device))
    weights, ids = routing_out
    if (weights.shape != (num_tokens, top_k) or ids.shape != (num_tokens, top_k) or weights.dtype != torch.float32
            or ids.dtype != torch.int32 or not weights.is_contiguous() or not ids.is_contiguous()):
        raise ValueError(f"routing_out must be contiguous [{num_tokens}, {top_k}] float32 and int32 tensors")
    return _Routing(weights.view(-1), ids.view(-1), top_k, logits, num_experts,
                    (True, block_topk, block_e, renormalize))
