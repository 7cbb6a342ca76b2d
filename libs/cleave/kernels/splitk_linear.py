"""Split-K tensor-core linear layer for decode batches of 17-64 rows, with its fusions.

At 64 rows a projection is still a pass over its weights (a Llama-3.2-1B layer reads 122 MB
of weights against 0.5 MB of activations), but each program now also reads a [64, K] slab of
activations from L2 for every `BLOCK_N` features it owns. Splitting K across programs keeps
each program's share of both small: program (feature block, split) multiplies a
[rows, K / SPLIT_K] slice of the activations by its [BLOCK_N, K / SPLIT_K] weight slice
with `tl.dot`, writes the fp32 partial product, and counts itself done on the feature
block's counter. The split that finishes last adds the other splits' partials to its own,
applies the epilogue and resets the counter, so the reduction costs no extra launch.

The fusions are `small_linear`'s:

- NORM: the input is the residual stream, RMS-normalised on the fly. No program sees a whole
  row, so each accumulates its slice's sum of squares beside its product of the
  weight-scaled input (x * norm_weight) @ W^T; the last split sums both and scales the row
  by its inverse RMS at the end. The result is the normalised product, rounded once,
  instead of being rounded after the normalisation as well.
- GATED: the weight is gate_up ([2I, K], gate rows first); a program computes both halves
  of its features and the last split writes silu(gate) * up.
- ADD: the product, rounded to the activation dtype, is added in place into the residual
  stream (`out`), which no other program touches.

Launched with programmatic dependent launch where the device has it: each program loads its
first weight tile before waiting on the previous kernel (weights are never written during a
step), and the counters are only touched after the wait, so consecutive launches can share
one counter buffer (the previous launch has reset every counter it used by then).

Measured on an H200 (bench/results/decode/splitk): at 64 rows it beats the tensor-core
kernel of `small_linear` 1.5-2.3x per projection and ties cuBLAS without the norm (o, down),
but the fused norm makes qkv and gate_up slower than cuBLAS plus a norm kernel (16.7 vs 9.0
us for qkv), so the model's decode path stays on cuBLAS above 16 tokens.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from cleave.kernels.dispatch import CachedLauncher
from cleave.kernels.linear_common import linear_tile, store_linear_output
from cleave.kernels.pdl import launch_options, pdl_enabled, release_dependents, wait_for_producer

TARGET_PROGRAMS = 256  # about two programs per SM of a 132-SM GPU
MAX_SPLIT_K = 16


@triton.jit
def _weight_tile(w_rows, up_offset, cols, feature_valid, k_end, GATED: tl.constexpr):
    """The weight tile [BLOCK_N, BLOCK_K] at columns `cols` (masked to < k_end), and its up
    half when GATED (else the same tile again)."""
    w_mask = feature_valid[:, None] & (cols < k_end)[None, :]
    w = tl.load(w_rows + cols[None, :], mask=w_mask, other=0.0)
    w_up = w
    if GATED:
        w_up = tl.load(w_rows + up_offset + cols[None, :], mask=w_mask, other=0.0)
    return w, w_up


@triton.jit
def _splitk_tile(
    x_rows, norm_w_ptr, cols, row_valid, k_end, w, w_up, acc, acc_up, sumsq,
    NORM: tl.constexpr, GATED: tl.constexpr, DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """One K tile: accumulate x[:, cols] (weight-scaled when NORM) @ w.T (and @ w_up.T)."""
    col_valid = cols < k_end
    x = tl.load(x_rows + cols[None, :], mask=row_valid[:, None] & col_valid[None, :], other=0.0)
    if NORM:
        xf = x.to(tl.float32)
        sumsq += tl.sum(xf * xf, axis=1)
        norm_w = tl.load(norm_w_ptr + cols, mask=col_valid, other=0.0).to(tl.float32)
        x = (xf * norm_w[None, :]).to(x.dtype)
    x = x.to(DOT_DTYPE)
    acc = tl.dot(x, tl.trans(w.to(DOT_DTYPE)), acc, input_precision=DOT_PRECISION)
    if GATED:
        acc_up = tl.dot(x, tl.trans(w_up.to(DOT_DTYPE)), acc_up, input_precision=DOT_PRECISION)
    return acc, acc_up, sumsq


@triton.jit(do_not_specialize=["num_rows"])
def _splitk_linear_kernel(
    x_ptr,  # [M, K] (NORM: the residual stream)
    w_ptr,  # [N, K] (GATED: [2N, K], gate rows then up rows)
    norm_w_ptr,  # [K] RMSNorm weight when NORM
    out_ptr,  # [M, N]; ADD: the residual stream, updated in place
    part_ptr,  # [SPLIT_K, BLOCK_M, N_PART] fp32 partial products (N_PART = 2N when GATED)
    sumsq_ptr,  # [SPLIT_K, feature blocks, BLOCK_M] fp32 partial sums of squares (NORM)
    counters_ptr,  # [>= feature blocks] int32, zero between launches
    num_rows,
    num_out,  # N: output features
    num_in,  # K
    stride_x_row,
    stride_w_row,
    stride_out_row,
    k_per_split,  # a multiple of BLOCK_K
    eps,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    NORM: tl.constexpr,
    GATED: tl.constexpr,
    ADD: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    PDL: tl.constexpr,
):
    block = tl.program_id(0)
    split = tl.program_id(1)
    rows, features, row_valid, feature_valid, x_rows, w_rows, up_offset = linear_tile(
        x_ptr, w_ptr, block, num_rows, num_out, stride_x_row, stride_w_row, BLOCK_M, BLOCK_N
    )
    k_start = split * k_per_split
    k_end = tl.minimum(num_in, k_start + k_per_split)

    # Weights are not written during a step: the first tile streams in before the wait.
    release_dependents(PDL)
    cols = k_start + tl.arange(0, BLOCK_K)  # [BLOCK_K]
    w, w_up = _weight_tile(w_rows, up_offset, cols, feature_valid, k_end, GATED)  # [BLOCK_N, BLOCK_K]
    wait_for_producer(PDL)

    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    sumsq = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc, acc_up, sumsq = _splitk_tile(
        x_rows, norm_w_ptr, cols, row_valid, k_end, w, w_up, acc, acc_up, sumsq, NORM, GATED, DOT_DTYPE, DOT_PRECISION,
    )
    for k0 in range(k_start + BLOCK_K, k_end, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        w, w_up = _weight_tile(w_rows, up_offset, cols, feature_valid, k_end, GATED)
        acc, acc_up, sumsq = _splitk_tile(
            x_rows, norm_w_ptr, cols, row_valid, k_end, w, w_up, acc, acc_up, sumsq,
            NORM, GATED, DOT_DTYPE, DOT_PRECISION,
        )

    if SPLIT_K > 1:
        n_part = num_out * (2 if GATED else 1)
        part_rows = part_ptr + rows[:, None] * n_part + features[None, :]  # [BLOCK_M, BLOCK_N], split 0
        part_mask = row_valid[:, None] & feature_valid[None, :]
        split_stride = BLOCK_M * n_part
        sumsq_row = sumsq_ptr + block * BLOCK_M + rows  # [BLOCK_M], split 0
        sumsq_stride = tl.num_programs(0) * BLOCK_M
        tl.store(part_rows + split * split_stride, acc, mask=part_mask)
        if GATED:
            tl.store(part_rows + split * split_stride + num_out, acc_up, mask=part_mask)
        if NORM:
            tl.store(sumsq_row + split * sumsq_stride, sumsq)
        # Every thread's partials are written before the counter moves (release); the split
        # that moves it last sees them all (acquire) and finishes the block.
        tl.debug_barrier()
        counter = counters_ptr + block
        if tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") != SPLIT_K - 1:
            return
        tl.debug_barrier()
        for other in tl.static_range(SPLIT_K):
            if other != split:
                acc += tl.load(part_rows + other * split_stride, mask=part_mask, other=0.0, cache_modifier=".cg")
                if GATED:
                    acc_up += tl.load(part_rows + other * split_stride + num_out, mask=part_mask, other=0.0,
                                      cache_modifier=".cg")
                if NORM:
                    sumsq += tl.load(sumsq_row + other * sumsq_stride, cache_modifier=".cg")
        tl.atomic_xchg(counter, 0)

    if NORM:
        rstd = tl.math.rsqrt(sumsq / num_in + eps)  # [BLOCK_M]
        acc = acc * rstd[:, None]
        acc_up = acc_up * rstd[:, None]
    store_linear_output(acc, acc_up, out_ptr, rows, features, row_valid, feature_valid, stride_out_row, GATED, ADD)


_launcher = CachedLauncher(_splitk_linear_kernel)


def _pow2_floor(value: int) -> int:
    return 1 << (max(1, value).bit_length() - 1)


def choose_split_k(num_blocks: int, k_tiles: int, block_k: int, block_m: int) -> int:
    """A power of two that brings the grid to about TARGET_PROGRAMS, keeping at least two K
    tiles per split and the fp32 partials (block_m x 4 bytes per feature and split) at most a
    quarter of the bf16 weight bytes they stand for (k_per_split x 2 bytes per feature)."""
    wanted = triton.next_power_of_2(triton.cdiv(TARGET_PROGRAMS, max(1, num_blocks)))
    by_partials = _pow2_floor(k_tiles * block_k // (8 * block_m))
    return max(1, min(wanted, MAX_SPLIT_K, _pow2_floor(k_tiles // 2), by_partials))


def launch_splitk_linear(
    x: torch.Tensor,  # [M, K]
    weight: torch.Tensor,  # [N, K] (gated: [2N, K])
    norm_weight: torch.Tensor | None,
    out: torch.Tensor,  # [M, N]; the residual stream when add
    eps: float,
    gated: bool,
    add: bool,
    dot_dtype: tl.dtype,
    precision: str,
    counters: torch.Tensor | None = None,  # int32 zeros, >= N / block_n of them; allocated when None
    block_n: int | None = None,
    block_k: int | None = None,
    split_k: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    pdl: bool = True,
) -> None:
    """out (+)= epilogue(x @ weight.T) through the split-K kernel (shapes checked by the caller)."""
    num_rows, num_in = x.shape
    num_out = out.shape[1]
    block_m = max(16, triton.next_power_of_2(num_rows))
    block_n = block_n or min(64, max(16, triton.next_power_of_2(num_out)))
    block_k = block_k or min(128, max(16, triton.next_power_of_2(num_in)))
    num_blocks = triton.cdiv(num_out, block_n)
    k_tiles = triton.cdiv(num_in, block_k)
    split_k = split_k or choose_split_k(num_blocks, k_tiles, block_k, block_m)
    k_per_split = triton.cdiv(k_tiles, split_k) * block_k
    if split_k > 1:
        n_part = num_out * (2 if gated else 1)
        part = torch.empty((split_k, block_m, n_part), dtype=torch.float32, device=x.device)
        sumsq = torch.empty((split_k, num_blocks, block_m), dtype=torch.float32, device=x.device)
        if counters is None or counters.numel() < num_blocks:
            counters = torch.zeros(num_blocks, dtype=torch.int32, device=x.device)
    else:
        part = sumsq = counters = out
    pdl = pdl_enabled(x, pdl)
    _launcher(
        (num_blocks, split_k),
        (x, weight, x if norm_weight is None else norm_weight, out, part, sumsq, counters,
         num_rows, num_out, num_in, x.stride(0), weight.stride(0), out.stride(0), k_per_split, eps),
        (block_m, block_n, block_k, split_k, norm_weight is not None, gated, add, dot_dtype, precision, pdl),
        num_warps or 4, num_stages=num_stages or 3, **launch_options(pdl),
    )
