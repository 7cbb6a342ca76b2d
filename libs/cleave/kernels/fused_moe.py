"""Fused mixture-of-experts layer: routing, token-to-expert alignment, grouped GEMMs.

The layer runs as seven launches, none of which reads a value back to the
host, so it can be captured in a CUDA graph:

1. `route`: per token, softmax over the router logits, top-k (ties: the lower expert id),
   renormalised when asked -> weights [T, k] fp32, ids [T, k] int32.
2. `align_block_size` (three small launches): the T*k (token, slot) entries grouped by
   expert, each group padded to a multiple of BLOCK_M with a sentinel. Every output has a
   size fixed by T, k, E and BLOCK_M (T*k + E*(BLOCK_M - 1) entries at most); the padded
   length lives on the device.
3. First grouped GEMM: each program takes one BLOCK_M block of entries (all one expert's)
   and BLOCK_N columns of both its gate and up rows, and applies the gated activation in
   its epilogue -> intermediate [T*k, I].
4. Second grouped GEMM: intermediate @ w2[expert].T (+ bias), times the entry's routing
   weight in the epilogue -> [T*k, H] in the activations' dtype (each weighted expert output
   rounded once, as transformers rounds it before its sum); then one launch sums the k slots
   in fp32 and rounds once more -> [T, H] (no atomics, so the result is deterministic).

Blocks past the padded length return at once, so the grid is sized for the worst case.
Tiles come from `cleave.kernels.moe_tiles` (a table tuned on the device, else a built-in
rule). The design follows vLLM's Triton fused_moe. Up to a few tokens (decode) skip steps 2-4:
`cleave.kernels.moe_gemv` runs each (token, expert) entry as a GEMV, in two launches, and
given the router logits it routes inside the first of them (`moe_routing.top_k_routing`,
the helper `route` runs too), so a decode MoE layer needs no routing launch. Torch
references are in `moe_reference.py`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import triton
import triton.language as tl

from cleave.kernels.attention_common import dot_settings
from cleave.kernels.dispatch import CachedLauncher, Impl, use_triton
from cleave.kernels.moe_gemv import MAX_TOKENS as GEMV_MAX_TOKENS
from cleave.kernels.moe_gemv import down_depth_for, gated_activation, moe_gemv
from cleave.kernels.moe_reference import SILU, MoEActivation, fused_experts_reference, route_reference
from cleave.kernels.moe_routing import routing_blocks, store_routing, top_k_routing
from cleave.kernels.moe_tiles import GemmTiles, MoELaunch, moe_launch
from cleave.kernels.mxfp4 import MXFP4Weight, decode_e2m1, dense_weight, e8m0_scale, weight_launch_args
from cleave.kernels.pdl import launch_options, pdl_enabled, release_dependents, wait_for_producer


ALIGN_MAX_PROGRAMS = 64  # chunks the alignment's count and scatter kernels split the entries into
# Router logits a routing warp holds per program before another warp joins (`route_num_warps`):
# 128 experts (Qwen3-30B-A3B) are four a thread of one warp.
ROUTE_EXPERTS_PER_WARP = 128


@dataclass(frozen=True)
class AlignedEntries:
    """The (token, slot) entries grouped by expert for the grouped GEMMs.

    `sorted_ids` [max_padded] int32: flat entry ids (token * k + slot), grouped by expert and
    padded with `num_entries`; `expert_ids` [max_padded / block_size] int32: the expert of
    each block (-1 past the padded length); `num_padded` [1] int32: the padded length.
    """

    sorted_ids: torch.Tensor
    expert_ids: torch.Tensor
    num_padded: torch.Tensor
    block_size: int
    num_entries: int


@triton.jit
def _route_kernel(
    logits_ptr,  # [T, E]
    out_weights_ptr,  # [T, TOP_K] fp32
    out_ids_ptr,  # [T, TOP_K] int32
    num_experts,
    stride_logits,
    TOP_K: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_E: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    PDL: tl.constexpr,
):
    # a program per token; the per-entry GEMVs route inside their first kernel with the same helper
    wait_for_producer(PDL)
    release_dependents(PDL)
    row = tl.program_id(0).to(tl.int64)
    weights, ids = top_k_routing(logits_ptr + row * stride_logits, num_experts, TOP_K, BLOCK_K, BLOCK_E, RENORMALIZE)
    store_routing(weights, ids, out_weights_ptr + row * TOP_K, out_ids_ptr + row * TOP_K, TOP_K, BLOCK_K)


@triton.jit(do_not_specialize=["num_entries", "chunk"])
def _align_count_kernel(
    topk_ids_ptr,  # [N] flat entries' expert ids
    counts_ptr,  # [P, BLOCK_E] int32: entries per expert in each program's chunk
    num_entries,
    chunk,  # entries per program, a multiple of BLOCK_T
    BLOCK_E: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    program = tl.program_id(0)
    experts = tl.arange(0, BLOCK_E)
    counts = tl.zeros([BLOCK_E], dtype=tl.int32)
    for start in range(program * chunk, (program + 1) * chunk, BLOCK_T):
        entries = start + tl.arange(0, BLOCK_T)
        ids = tl.load(topk_ids_ptr + entries, mask=entries < num_entries, other=-1)
        counts += tl.sum((ids[:, None] == experts[None, :]).to(tl.int32), axis=0)
    tl.store(counts_ptr + program * BLOCK_E + experts, counts)


@triton.jit(do_not_specialize=["num_programs", "max_blocks"])
def _align_offsets_kernel(
    counts_ptr,  # [P, BLOCK_E] int32
    offsets_ptr,  # [P, BLOCK_E] int32: where each chunk's first entry of each expert goes
    expert_ids_ptr,  # [max_blocks]
    num_padded_ptr,  # [1]
    num_programs,
    num_experts,
    max_blocks,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    # One program: pad each expert's count to BLOCK_SIZE, prefix-sum over experts (group
    # starts) and over chunks (each chunk's place within its groups), label the blocks.
    programs = tl.arange(0, BLOCK_P)
    experts = tl.arange(0, BLOCK_E)
    cells = programs[:, None] * BLOCK_E + experts[None, :]
    program_valid = (programs < num_programs)[:, None]
    counts = tl.load(counts_ptr + cells, mask=program_valid, other=0)  # [P, E]
    before = tl.cumsum(counts, axis=0) - counts  # entries of earlier chunks, per expert
    padded = (tl.sum(counts, axis=0) + BLOCK_SIZE - 1) // BLOCK_SIZE * BLOCK_SIZE
    ends = tl.cumsum(padded, axis=0)  # [E] end of each expert's group
    total = tl.sum(padded, axis=0)
    tl.store(num_padded_ptr, total)
    tl.store(offsets_ptr + cells, (ends - padded)[None, :] + before, mask=program_valid)
    for start in range(0, max_blocks, BLOCK_T):
        blocks = start + tl.arange(0, BLOCK_T)
        first = blocks * BLOCK_SIZE
        # the block's expert = how many groups end at or before its first entry
        expert = tl.sum(((first[:, None] >= ends[None, :]) & (experts[None, :] < num_experts)).to(tl.int32), axis=1)
        tl.store(expert_ids_ptr + blocks, tl.where(first < total, expert, -1), mask=blocks < max_blocks)


@triton.jit(do_not_specialize=["num_entries", "chunk"])
def _align_scatter_kernel(
    topk_ids_ptr,  # [N]
    offsets_ptr,  # [P, BLOCK_E]
    sorted_ids_ptr,  # [max_padded], prefilled with N
    num_entries,
    num_experts,
    chunk,
    BLOCK_E: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    program = tl.program_id(0)
    experts = tl.arange(0, BLOCK_E)
    next_place = tl.load(offsets_ptr + program * BLOCK_E + experts)  # [E]
    for start in range(program * chunk, (program + 1) * chunk, BLOCK_T):
        entries = start + tl.arange(0, BLOCK_T)
        ids = tl.load(topk_ids_ptr + entries, mask=entries < num_entries, other=-1)
        one_hot = (ids[:, None] == experts[None, :]).to(tl.int32)  # [BLOCK_T, E]
        places = next_place[None, :] + tl.cumsum(one_hot, axis=0) - 1  # in entry order within each expert
        place = tl.sum(tl.where(one_hot == 1, places, 0), axis=1)
        is_entry = (entries < num_entries) & (ids >= 0) & (ids < num_experts)
        tl.store(sorted_ids_ptr + place, entries, mask=is_entry)
        next_place += tl.sum(one_hot, axis=0)


@triton.jit
def _mxfp4_tile(rows, scale_rows, k0, col_valid, K, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr,
                DOT_DTYPE: tl.constexpr):
    """The K tile at k0 of MXFP4 weight rows (`rows`, `scale_rows`: [BN] row starts) as two
    [BLOCK_K // 2, BN] operands in DOT_DTYPE, the tile's even and odd k (low and high nibbles),
    each value times its group's scale."""
    packed = k0 // 2 + tl.arange(0, BLOCK_K // 2)
    codes = tl.load(rows[None, :] + packed[:, None], mask=(packed < K // 2)[:, None] & col_valid[None, :],
                    other=0).to(tl.int32)  # [BK/2, BN]
    groups = k0 // 32 + tl.arange(0, BLOCK_K // 32)
    scales = e8m0_scale(tl.load(scale_rows[None, :] + groups[:, None],
                                mask=(groups < K // 32)[:, None] & col_valid[None, :], other=0).to(tl.int32))
    scales = scales[:, None, :]  # [BK/32, 1, BN]: one per 16 bytes of a row
    low = tl.reshape(tl.reshape(decode_e2m1(codes & 15), [BLOCK_K // 32, 16, BLOCK_N]) * scales,
                     [BLOCK_K // 2, BLOCK_N])
    high = tl.reshape(tl.reshape(decode_e2m1(codes >> 4), [BLOCK_K // 32, 16, BLOCK_N]) * scales,
                      [BLOCK_K // 2, BLOCK_N])
    return low.to(DOT_DTYPE), high.to(DOT_DTYPE)


@triton.jit
def _mxfp4_dot(a, rows, scale_rows, k0, col_valid, K, acc, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
               BLOCK_N: tl.constexpr, DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """acc + a [BM, BK] @ the MXFP4 tile's [BK, BN]: a's even and odd columns against the
    low and high nibbles, so the decoded values need no interleaving."""
    a_even, a_odd = tl.split(tl.reshape(a, [BLOCK_M, BLOCK_K // 2, 2]))
    low, high = _mxfp4_tile(rows, scale_rows, k0, col_valid, K, BLOCK_K, BLOCK_N, DOT_DTYPE)
    acc = tl.dot(a_even.to(DOT_DTYPE), low, acc, input_precision=DOT_PRECISION)
    return tl.dot(a_odd.to(DOT_DTYPE), high, acc, input_precision=DOT_PRECISION)


@triton.jit(do_not_specialize=["num_entries"])
def _moe_gemm_kernel(
    a_ptr,  # [rows, K]: hidden [T, K] (ROW_DIV = top_k) or intermediate [T*k, K] (ROW_DIV = 1)
    b_ptr,  # [E, N or 2N, K] (MXFP4: [E, N or 2N, K // 2] bytes)
    scale_ptr,  # MXFP4: [E, N or 2N, K // 32] scale codes
    bias_ptr,  # [E, N or 2N] when HAS_BIAS
    c_ptr,  # [T*k, N]
    topk_weights_ptr,  # [T*k] fp32 when MUL_WEIGHT
    sorted_ids_ptr,
    expert_ids_ptr,
    num_padded_ptr,
    N,
    K,
    num_entries,
    stride_a,
    stride_be,
    stride_bn,
    stride_se,
    stride_sn,
    stride_bias,
    stride_c,
    alpha,
    limit,
    ROW_DIV: tl.constexpr,
    GATED: tl.constexpr,
    CLAMPED: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    MUL_WEIGHT: tl.constexpr,
    MXFP4: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    entry = tl.load(sorted_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)  # [BM]
    row_valid = entry < num_entries
    a_rows = a_ptr + (entry // ROW_DIV) * stride_a  # [BM]
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    col_valid = cols < N
    b_expert = b_ptr + expert * stride_be
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if MXFP4:
        b_rows = b_expert + cols.to(tl.int64) * stride_bn  # [BN] row starts (bytes)
        scale_rows = scale_ptr + expert * stride_se + cols.to(tl.int64) * stride_sn
        up_offset = N.to(tl.int64) * stride_bn
        up_scale_offset = N.to(tl.int64) * stride_sn
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_valid = ks < K
        a = tl.load(a_rows[:, None] + ks[None, :], mask=row_valid[:, None] & k_valid[None, :], other=0.0)
        if MXFP4:
            acc = _mxfp4_dot(a, b_rows, scale_rows, k0, col_valid, K, acc, BLOCK_M, BLOCK_K, BLOCK_N, DOT_DTYPE,
                             DOT_PRECISION)
            if GATED:
                acc_up = _mxfp4_dot(a, b_rows + up_offset, scale_rows + up_scale_offset, k0, col_valid, K, acc_up,
                                    BLOCK_M, BLOCK_K, BLOCK_N, DOT_DTYPE, DOT_PRECISION)
        else:
            b_mask = k_valid[:, None] & col_valid[None, :]
            b = tl.load(b_expert + cols[None, :] * stride_bn + ks[:, None], mask=b_mask, other=0.0)  # [BK, BN]
            acc = tl.dot(a.to(DOT_DTYPE), b.to(DOT_DTYPE), acc, input_precision=DOT_PRECISION)
            if GATED:
                b_up = tl.load(b_expert + (cols + N)[None, :] * stride_bn + ks[:, None], mask=b_mask, other=0.0)
                acc_up = tl.dot(a.to(DOT_DTYPE), b_up.to(DOT_DTYPE), acc_up, input_precision=DOT_PRECISION)
    if HAS_BIAS:
        bias_row = bias_ptr + expert * stride_bias
        acc += tl.load(bias_row + cols, mask=col_valid, other=0.0).to(tl.float32)[None, :]
        if GATED:
            acc_up += tl.load(bias_row + N + cols, mask=col_valid, other=0.0).to(tl.float32)[None, :]
    if GATED:
        acc = gated_activation(acc, acc_up, alpha, limit, CLAMPED)
    if MUL_WEIGHT:
        acc = acc * tl.load(topk_weights_ptr + entry, mask=row_valid, other=0.0)[:, None]
    c_ptrs = c_ptr + entry[:, None] * stride_c + cols[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=row_valid[:, None] & col_valid[None, :])


@triton.jit
def _slot_sum_kernel(
    per_slot_ptr,  # [T * TOP_K, H]: each (token, slot) entry's weighted expert output
    out_ptr,  # [T, H]
    hidden_size,
    TOP_K: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    # a program per (token, BLOCK_H columns): the slots summed in fp32, rounded once on the store
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    valid = cols < hidden_size
    first = per_slot_ptr + token * TOP_K * hidden_size + cols
    total = tl.load(first, mask=valid, other=0.0).to(tl.float32)
    for slot in tl.static_range(1, TOP_K):
        total += tl.load(first + slot * hidden_size, mask=valid, other=0.0).to(tl.float32)
    tl.store(out_ptr + token * hidden_size + cols, total.to(out_ptr.dtype.element_ty), mask=valid)


SLOT_SUM_BLOCK_H = 1024  # columns a slot-sum program adds: 2-4 KiB of each slot's row


def sum_slots(per_slot: torch.Tensor, top_k: int, out: torch.Tensor) -> torch.Tensor:
    """out [T, H] = per_slot [T * top_k, H] (contiguous, any float dtype) summed in fp32 over
    each token's top_k rows, rounded once to out's dtype: one pass over the slots (a torch
    sum, then a cast, reads and writes the [T, H] sum once more in fp32)."""
    num_tokens, hidden_size = out.shape
    if per_slot.shape != (num_tokens * top_k, hidden_size) or not per_slot.is_contiguous() or not out.is_contiguous():
        raise ValueError(f"sum_slots wants contiguous per_slot [{num_tokens * top_k}, {hidden_size}] and out "
                         f"[{num_tokens}, {hidden_size}], got {tuple(per_slot.shape)} and {tuple(out.shape)}")
    if num_tokens:
        block_h = min(SLOT_SUM_BLOCK_H, triton.next_power_of_2(hidden_size))
        grid = (num_tokens, triton.cdiv(hidden_size, block_h))
        _slot_sum_kernel[grid](per_slot, out, hidden_size, TOP_K=top_k, BLOCK_H=block_h,
                               num_warps=max(1, min(8, block_h // 256)))
    return out


def route(
    router_logits: torch.Tensor,  # [T, E]
    top_k: int,
    renormalize: bool = True,
    impl: Impl = "auto",
    pdl: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:  # weights [T, k] fp32, ids [T, k] int32
    """Top-k experts per token and their routing weights (see `route_reference`); `pdl`:
    launched with programmatic dependent launch where the device has it (it waits on the
    kernel before it, then lets the next one in)."""
    if not use_triton(router_logits, impl):
        return route_reference(router_logits, top_k, renormalize)
    num_tokens, num_experts = router_logits.shape
    block_k, block_e = routing_blocks(num_experts, top_k)
    logits = router_logits if router_logits.stride(-1) == 1 else router_logits.contiguous()
    weights = torch.empty(num_tokens, top_k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(num_tokens, top_k, dtype=torch.int32, device=logits.device)
    if num_tokens:
        pdl = pdl_enabled(logits, pdl)
        _route_launcher((num_tokens,), (logits, weights, ids, num_experts, logits.stride(0)),
                        (top_k, block_k, block_e, renormalize, pdl), route_num_warps(num_experts),
                        **launch_options(pdl))
    return weights, ids


_route_launcher = CachedLauncher(_route_kernel)


def route_num_warps(num_experts: int) -> int:
    """Warps of a routing program: one while a warp holds the token's logits in a few
    registers a thread (each top-k round is then a shuffle reduction with no barrier), up to
    four for wider routers."""
    return max(1, min(4, triton.cdiv(num_experts, ROUTE_EXPERTS_PER_WARP)))


def _align_layout(num_entries: int, num_experts: int) -> tuple[int, int, int, int]:
    """The alignment's (BLOCK_E, BLOCK_T, programs, entries per program) for `num_entries`."""
    block_e = triton.next_power_of_2(num_experts)
    block_t = max(16, min(128, 8192 // block_e))
    num_programs = max(1, min(ALIGN_MAX_PROGRAMS, triton.cdiv(num_entries, block_t)))
    chunk = max(1, triton.cdiv(triton.cdiv(num_entries, num_programs), block_t)) * block_t
    return block_e, block_t, max(1, triton.cdiv(num_entries, chunk)), chunk


def align_block_size(topk_ids: torch.Tensor, num_experts: int, block_size: int) -> AlignedEntries:
    """Group the flat (token, slot) entries by expert, each group padded to `block_size`,
    on the device (outputs sized for the worst case: see `AlignedEntries`).

    Three launches: per-chunk counts (up to ALIGN_MAX_PROGRAMS chunks side by side), one
    program for the offsets and block labels, then each chunk scatters its entries."""
    num_entries = topk_ids.numel()
    max_padded = num_entries + num_experts * (block_size - 1)
    max_blocks = triton.cdiv(max_padded, block_size)
    max_padded = max_blocks * block_size
    device = topk_ids.device
    flat_ids = topk_ids.reshape(-1)
    block_e, block_t, num_programs, chunk = _align_layout(num_entries, num_experts)
    sorted_ids = torch.full((max_padded,), num_entries, dtype=torch.int32, device=device)
    expert_ids = torch.empty(max_blocks, dtype=torch.int32, device=device)
    num_padded = torch.empty(1, dtype=torch.int32, device=device)
    counts = torch.empty(num_programs, block_e, dtype=torch.int32, device=device)
    offsets = torch.empty_like(counts)
    _align_count_kernel[(num_programs,)](flat_ids, counts, num_entries, chunk, BLOCK_E=block_e, BLOCK_T=block_t)
    _align_offsets_kernel[(1,)](
        counts, offsets, expert_ids, num_padded, num_programs, num_experts, max_blocks,
        BLOCK_SIZE=block_size, BLOCK_E=block_e, BLOCK_P=triton.next_power_of_2(num_programs), BLOCK_T=block_t,
        num_warps=8,
    )
    _align_scatter_kernel[(num_programs,)](
        flat_ids, offsets, sorted_ids, num_entries, num_experts, chunk, BLOCK_E=block_e, BLOCK_T=block_t,
    )
    return AlignedEntries(sorted_ids, expert_ids, num_padded, block_size, num_entries)


def grouped_gemm(
    a: torch.Tensor,
    weight: torch.Tensor | MXFP4Weight,
    bias: torch.Tensor | None,
    out: torch.Tensor,
    aligned: AlignedEntries,
    tiles: GemmTiles,
    row_div: int,
    activation: MoEActivation | None,
    topk_weights: torch.Tensor | None,
) -> None:
    """out[entry] = a[entry // row_div] @ weight[expert].T (+ bias) for every aligned entry:
    the activation of gate and up (`activation`, gate_up) or times the routing weight
    (`topk_weights`, down). One launch; the tuner (`bench/moe_tune.py`) times it alone."""
    gated = activation is not None
    out_features = out.shape[1]
    dot_dtype, precision = dot_settings(a)
    quantized = isinstance(weight, MXFP4Weight)
    if quantized and tiles.block_k < 32:
        raise ValueError(f"MXFP4 weights need block_k >= 32 (one scale group), got {tiles.block_k}")
    weights, scales, stride_we, stride_wn, stride_se, stride_sn = weight_launch_args(weight)
    grid = (aligned.expert_ids.shape[0], triton.cdiv(out_features, tiles.block_n))
    _moe_gemm_kernel[grid](
        a, weights, scales, bias if bias is not None else a, out,
        topk_weights if topk_weights is not None else out,
        aligned.sorted_ids, aligned.expert_ids, aligned.num_padded,
        out_features, a.shape[1], aligned.num_entries,
        a.stride(0), stride_we, stride_wn, stride_se, stride_sn, bias.stride(0) if bias is not None else 0,
        out.stride(0),
        activation.alpha if gated else 0.0, activation.limit if gated else 0.0,
        ROW_DIV=row_div, GATED=gated, CLAMPED=gated and activation.kind == "swiglu_clamped",
        HAS_BIAS=bias is not None, MUL_WEIGHT=topk_weights is not None, MXFP4=quantized,
        BLOCK_M=aligned.block_size, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k,
        DOT_DTYPE=dot_dtype, DOT_PRECISION=precision, num_warps=tiles.num_warps, num_stages=tiles.num_stages,
    )


def fused_experts(
    hidden: torch.Tensor,  # [T, H]
    w13: torch.Tensor | MXFP4Weight,  # [E, 2I, H]
    w2: torch.Tensor | MXFP4Weight,  # [E, H, I]
    topk_weights: torch.Tensor,  # [T, k] fp32
    topk_ids: torch.Tensor,  # [T, k] int32
    activation: MoEActivation = SILU,
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
    impl: Impl = "auto",
    kernel: Literal["auto", "grouped", "gemv"] = "auto",
    launch: MoELaunch | None = None,
) -> torch.Tensor:  # [T, H]
    """sum_k topk_weights[t, k] * expert_{topk_ids[t, k]}(hidden[t]) (see module docstring).

    `kernel` "auto" runs up to `moe_gemv.MAX_TOKENS` tokens as per-entry GEMVs
    (`cleave.kernels.moe_gemv`: no alignment, two launches) and more through the grouped GEMMs,
    tiled by `launch` (default: `moe_tiles.moe_launch`, a tuned table where the device has one).
    MXFP4 weights are read packed by both (the torch reference dequantises them)."""
    if kernel not in ("auto", "grouped", "gemv"):
        raise ValueError(f"kernel must be 'auto', 'grouped' or 'gemv', got {kernel!r}")
    if not use_triton(hidden, impl):
        return fused_experts_reference(hidden, dense_weight(w13, hidden.dtype), dense_weight(w2, hidden.dtype),
                                       topk_weights, topk_ids, activation, w13_bias, w2_bias)
    num_tokens, hidden_size = hidden.shape
    num_experts, inter2, _ = w13.shape
    top_k = topk_ids.shape[1]
    inter = inter2 // 2
    for name, tensor in (("hidden", hidden), ("w13", w13), ("w2", w2)):
        if isinstance(tensor, torch.Tensor) and tensor.stride(-1) != 1:  # MXFP4Weight checks its own
            raise ValueError(f"{name} must be contiguous in its last dimension")
    if kernel == "gemv" or (kernel == "auto" and num_tokens <= GEMV_MAX_TOKENS):
        return moe_gemv(hidden, w13, w2, topk_weights, topk_ids.to(torch.int32), activation, w13_bias, w2_bias)
    out = torch.empty(num_tokens, hidden_size, dtype=hidden.dtype, device=hidden.device)
    if num_tokens == 0:
        return out
    num_entries = num_tokens * top_k
    launch = launch or moe_launch(num_tokens, top_k, num_experts, inter, hidden_size, hidden,
                                  mxfp4=isinstance(w13, MXFP4Weight))
    aligned = align_block_size(topk_ids.to(torch.int32), num_experts, launch.block_m)
    intermediate = torch.empty(num_entries, inter, dtype=hidden.dtype, device=hidden.device)
    grouped_gemm(hidden, w13, w13_bias, intermediate, aligned, launch.gate_up, top_k, activation, None)
    # Slot outputs in the activations' dtype: half the bytes of fp32 for the down GEMM to write
    # and the sum to read ([T*k, H]: 268 MB a layer for Qwen3-30B-A3B's 8k prompt in bf16).
    per_slot = torch.empty(num_entries, hidden_size, dtype=hidden.dtype, device=hidden.device)
    grouped_gemm(intermediate, w2, w2_bias, per_slot, aligned, launch.down, 1, None,
                  topk_weights.reshape(-1).to(torch.float32))
    return sum_slots(per_slot, top_k, out)


def variant_token_counts(max_tokens: int, top_k: int, num_experts: int, inter: int, hidden: int,
                         activations: torch.Tensor, mxfp4: bool = False) -> list[int]:
    """Token counts, one for each kernel variant `fused_experts` compiles for 1..`max_tokens`
    tokens of these shapes (the smallest count that reaches it): the per-entry GEMVs' down
    depth up to `moe_gemv.MAX_TOKENS`, then each grouped-GEMM launch (`moe_launch`: tuned
    tables pick tiles by token count) with the alignment's program count, whose power of two
    its offsets kernel is compiled for. Running the experts once at each count compiles every
    variant a prefill or mixed step of up to `max_tokens` tokens can meet."""
    counts: dict[tuple, int] = {}
    for num_tokens in range(1, max_tokens + 1):
        if num_tokens <= GEMV_MAX_TOKENS:
            key: tuple = ("gemv", down_depth_for(num_tokens))
        else:
            launch = moe_launch(num_tokens, top_k, num_experts, inter, hidden, activations, mxfp4=mxfp4)
            programs = _align_layout(num_tokens * top_k, num_experts)[2]
            key = ("grouped", launch, triton.next_power_of_2(programs))
        counts.setdefault(key, num_tokens)
    return sorted(counts.values())


def fused_moe(
    hidden: torch.Tensor,  # [T, H]
    w13: torch.Tensor | MXFP4Weight,  # [E, 2I, H]
    w2: torch.Tensor | MXFP4Weight,  # [E, H, I]
    router_logits: torch.Tensor,  # [T, E]
    top_k: int,
    renormalize: bool = True,
    activation: MoEActivation = SILU,
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
    impl: Impl = "auto",
) -> torch.Tensor:  # [T, H]
    """The MoE layer after its router GEMM: routing, then the experts (Triton on CUDA)."""
    weights, ids = route(router_logits, top_k, renormalize, impl=impl)
    return fused_experts(hidden, w13, w2, weights, ids, activation, w13_bias, w2_bias, impl=impl)
