"""Linear layers for decode-sized batches (1-64 rows): weight-streaming Triton GEMV.

At a handful of rows a projection is a pass over its weight matrix, so time is bytes of
weight / HBM bandwidth, plus a few microseconds of launch and ramp per kernel. Each
program owns `BLOCK_N` output features and streams their weight rows (contiguous along K
in `nn.Linear`'s [N, K] layout) through a pipelined loop; the activations are padded to a
power of two of at least 16 rows for `tl.dot`. What would otherwise be separate kernels around the projection is fused:

- `norm_weight`: the input is the residual stream and is RMS-normalised on the fly (each
  program recomputes the rows' inverse RMS: the rows are a few KiB, the weights MiBs);
- `gated=True`: SwiGLU, the weight is gate_up ([2I, K], gate rows first) and each program
  computes both halves of its features and writes silu(gate) * up;
- `add_to`: the product is added in place into the residual stream (each program owns its
  features, so no two programs touch the same element) instead of being written out.

Rounding matches the unfused ops: the normalised input is rounded to the activation dtype
before the product, the product before it is added, the sum when it is stored.

On Hopper the kernel launches with programmatic dependent launch (`cleave.kernels.pdl`): its
programs are scheduled while the previous kernel finishes and wait on the device for its
output, so launch and ramp-up overlap the previous kernel's tail.

Split-K (`cleave.kernels.split_k`): a projection with few output tiles leaves SMs idle and
too few bytes in flight, so the grid is (feature tiles, SPLIT_K) and program (tile, split)
streams one slice of K. With SPLIT_K > 1 each program stores its fp32 partial into a
[SPLIT_K, M, N] workspace (gated: [SPLIT_K, M, 2N], gate then up) and counts itself done on
the tile's int32 counter; the last to arrive sums the partials in split order (bit-identical
run to run), applies the epilogue above and zeroes the counter. The NORM prologue still
takes each row's inverse RMS over all of K. With SPLIT_K == 1 there is no workspace and no
counter. The counters must be zero before a launch and are left zero after it, so one
buffer serves every launch of a stream (`CausalLM.gemv_counters`): a PDL launch touches
them only after its wait for the previous kernel.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from cleave.kernels.attention_common import dot_settings
from cleave.kernels.dispatch import Impl, use_triton
from cleave.kernels.pdl import (
    launch_options,
    pdl_enabled,
    release_dependents,
    wait_for_producer,
)
from cleave.kernels.rms_norm import rms_norm_reference
from cleave.kernels.split_k import (
    default_split_k,
    device_num_sms,
    split_k_range,
    split_k_buffers,
    steps_per_split,
    store_partial,
    sum_partials,
)

MAX_ROWS = 64


@triton.jit
def _small_linear_kernel(
    x_ptr,  # [M, K] (NORM: the residual stream)
    w_ptr,  # [N, K] (GATED: [2N, K], gate rows then up rows)
    norm_w_ptr,  # [K] RMSNorm weight when NORM
    out_ptr,  # [M, N]; ADD: the residual stream, updated in place
    part_ptr,  # [SPLIT_K, M, N] fp32 partials (GATED: [SPLIT_K, M, 2N]) when SPLIT_K > 1
    counters_ptr,  # [>= feature tiles] int32, zero between launches, when SPLIT_K > 1
    num_rows,
    num_out,  # N: output features
    num_in,  # K
    stride_x_row,
    stride_w_row,
    stride_out_row,
    eps,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    NORM: tl.constexpr,
    GATED: tl.constexpr,
    ADD: tl.constexpr,
    SPLIT_K: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    PDL: tl.constexpr,
):
    tile = tl.program_id(0)
    features = tile * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    rows = tl.arange(0, BLOCK_M)  # [BLOCK_M]
    feature_valid = features < num_out
    row_valid = rows < num_rows
    x_rows = x_ptr + rows[:, None] * stride_x_row  # [BLOCK_M, 1]
    w_rows = w_ptr + features.to(tl.int64)[:, None] * stride_w_row  # [BLOCK_N, 1]
    up_offset = num_out.to(tl.int64) * stride_w_row
    wait_for_producer(PDL)
    release_dependents(PDL)
    k_start, k_end = split_k_range(num_in, BLOCK_K, SPLIT_K)  # this split's slice of K

    if NORM:  # over the whole row, whatever the split
        squares = tl.zeros([BLOCK_M], dtype=tl.float32)
        for k0 in range(0, num_in, BLOCK_K):
            cols = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(x_rows + cols[None, :], mask=row_valid[:, None] & (cols < num_in)[None, :], other=0.0)
            squares += tl.sum(x.to(tl.float32) * x.to(tl.float32), axis=1)
        rstd = tl.math.rsqrt(squares / num_in + eps)  # [BLOCK_M]

    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)  # [BLOCK_K]; slices are whole steps, so only num_in cuts one
        col_valid = cols < num_in
        x = tl.load(x_rows + cols[None, :], mask=row_valid[:, None] & col_valid[None, :], other=0.0)  # [BLOCK_M, BLOCK_K]
        if NORM:
            norm_w = tl.load(norm_w_ptr + cols, mask=col_valid, other=0.0).to(tl.float32)
            normed = (x.to(tl.float32) * rstd[:, None]).to(x.dtype).to(tl.float32)
            x = (normed * norm_w[None, :]).to(x.dtype)
        w_mask = feature_valid[:, None] & col_valid[None, :]
        x = x.to(DOT_DTYPE)
        w = tl.load(w_rows + cols[None, :], mask=w_mask, other=0.0).to(DOT_DTYPE)  # [BLOCK_N, BLOCK_K]
        acc = tl.dot(x, tl.trans(w), acc, input_precision=DOT_PRECISION)
        if GATED:
            w_up = tl.load(w_rows + up_offset + cols[None, :], mask=w_mask, other=0.0).to(DOT_DTYPE)
            acc_up = tl.dot(x, tl.trans(w_up), acc_up, input_precision=DOT_PRECISION)

    out_mask = row_valid[:, None] & feature_valid[None, :]  # [BLOCK_M, BLOCK_N]
    out_offsets = rows[:, None] * stride_out_row + features[None, :]
    if SPLIT_K == 1:
        _write_output(out_ptr, out_offsets, out_mask, acc, acc_up, GATED, ADD)
    else:
        part_width = num_out * 2 if GATED else num_out
        part_ptrs = part_ptr + rows[:, None] * part_width + features[None, :]  # split 0's plane
        split_stride = num_rows * part_width  # elements per split's plane
        store_partial(part_ptrs, acc, out_mask, split_stride)
        if GATED:
            store_partial(part_ptrs + num_out, acc_up, out_mask, split_stride)
        # Every thread's partials are written before the counter moves (release); the split
        # that moves it last sees them all (acquire), reduces and writes the output.
        tl.debug_barrier()
        counter = counters_ptr + tile
        if tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") == SPLIT_K - 1:
            tl.debug_barrier()
            total = sum_partials(part_ptrs, out_mask, split_stride, SPLIT_K, BLOCK_M, BLOCK_N)
            total_up = total
            if GATED:
                total_up = sum_partials(part_ptrs + num_out, out_mask, split_stride, SPLIT_K, BLOCK_M, BLOCK_N)
            _write_output(out_ptr, out_offsets, out_mask, total, total_up, GATED, ADD)
            tl.atomic_xchg(counter, 0)


@triton.jit
def _write_output(out_ptr, out_offsets, out_mask, acc, acc_up, GATED: tl.constexpr, ADD: tl.constexpr):
    """The epilogue on fp32 products [BLOCK_M, BLOCK_N]: [silu(gate) * up], round, [+= out], store."""
    if GATED:
        acc = acc / (1.0 + tl.exp(-acc)) * acc_up
    out_ptrs = out_ptr + out_offsets
    result = acc.to(out_ptr.dtype.element_ty)
    if ADD:
        residual = tl.load(out_ptrs, mask=out_mask, other=0.0)
        result = (residual.to(tl.float32) + result.to(tl.float32)).to(out_ptr.dtype.element_ty)
    tl.store(out_ptrs, result, mask=out_mask)


def small_linear_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    gated: bool = False,
    norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    add_to: torch.Tensor | None = None,
) -> torch.Tensor:
    """The unfused ops: [rms_norm] -> x @ weight.T (fp32, cast) -> [silu(gate) * up] -> [add_to +=]."""
    if norm_weight is not None:
        x = rms_norm_reference(x, norm_weight, eps)
    out = F.linear(x.float(), weight.float())
    if gated:
        gate, up = out.chunk(2, dim=-1)
        out = F.silu(gate) * up
    out = out.to(x.dtype)
    if add_to is None:
        return out
    add_to.copy_((add_to.float() + out.float()).to(add_to.dtype))
    return add_to


def default_tiles(num_out: int, num_in: int, gated: bool, block_m: int = 16) -> tuple[int, int, int]:
    """(block_n, block_k, num_stages) measured best on an H200 for the Llama-3.2-1B projections.

    bench/results/kernels/small_linear.md: narrow outputs stream 16 features per program in
    512-wide steps (more programs in flight); wide or gated ones take 32 in 256-wide steps.
    More rows take narrower K steps so the pipelined activation tiles fit shared memory.
    """
    if block_m > 16:
        return (32, 128, 4) if gated else (16, 128, 4)
    if gated:
        return 32, 256, 3
    if num_out <= 2048:
        return 16, 512, 5
    return 32, 256, 5


SHARED_MEMORY_BUDGET = 192 << 10  # bytes of pipelined tiles per program (H100/H200: 227 KiB)


def _fit_stages(stages: int, block_m: int, weight_rows: int, block_k: int, element_size: int) -> int:
    """The most pipeline stages up to `stages` whose activation + weight tiles fit the budget."""
    per_stage = (block_m + weight_rows) * block_k * element_size
    return max(1, min(stages, SHARED_MEMORY_BUDGET // per_stage))


def small_linear(
    x: torch.Tensor,  # [M, K], M <= MAX_ROWS
    weight: torch.Tensor,  # [N, K] (gated: [2I, K])
    gated: bool = False,
    *,
    norm_weight: torch.Tensor | None = None,  # [K]: RMS-normalise x first
    eps: float = 1e-6,
    add_to: torch.Tensor | None = None,  # [M, N]: add the product into it in place
    impl: Impl = "auto",
    block_n: int | None = None,
    block_k: int | None = None,
    num_warps: int = 4,
    num_stages: int | None = None,
    pdl: bool = True,  # launch with PDL where the device has it
    split_k: int | None = None,  # slices of K; None: `default_split_k` for the shape
    counters: torch.Tensor | None = None,  # [>= N / block_n] int32, zero; None: zeroed per split call
) -> torch.Tensor:  # [M, N] (gated: [M, I]); `add_to` itself when given
    """x @ weight.T for at most MAX_ROWS rows, with the fusions described in the module doc.

    With `split_k` > 1 (the default for grids that would leave SMs idle) the result is the
    same up to fp32 summation order, and deterministic; `counters` should be a persistent
    zeroed buffer (it is left zeroed), else each call allocates and clears one.
    """
    if not use_triton(x, impl):
        return small_linear_reference(x, weight, gated, norm_weight, eps, add_to)
    num_rows, num_in = x.shape
    if num_rows > MAX_ROWS:
        raise ValueError(f"small_linear takes at most {MAX_ROWS} rows, got {num_rows}")
    if weight.shape[1] != num_in or x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError(f"need x [M, {weight.shape[1]}] and weight [N, K] contiguous along K, got {tuple(x.shape)}")
    num_out = weight.shape[0] // 2 if gated else weight.shape[0]
    if add_to is None:
        out = torch.empty((num_rows, num_out), dtype=x.dtype, device=x.device)
    elif add_to.shape != (num_rows, num_out) or add_to.stride(1) != 1:
        raise ValueError(f"add_to must be [{num_rows}, {num_out}] and contiguous along features, got {tuple(add_to.shape)}")
    else:
        out = add_to
    if num_rows == 0:
        return out
    dot_dtype, precision = dot_settings(x)  # the activations' dtype on a GPU; fp32 in the interpreter
    block_m = max(16, triton.next_power_of_2(num_rows))
    tiles = default_tiles(num_out, num_in, gated, block_m)
    block_n = block_n or min(tiles[0], max(16, triton.next_power_of_2(num_out)))
    block_k = block_k or min(tiles[1] * 2 // x.element_size(), max(16, triton.next_power_of_2(num_in)))
    num_tiles = triton.cdiv(num_out, block_n)
    if split_k is None:
        split_k = default_split_k(num_tiles, num_in, block_k, device_num_sms(x.device))
    if split_k < 1:
        raise ValueError(f"split_k must be at least 1, got {split_k}")
    if num_stages is None:
        num_stages = _fit_stages(tiles[2], block_m, block_n * (2 if gated else 1), block_k, x.element_size())
        if split_k > 1:  # stages past a split's steps only hold shared memory (fewer CTAs per SM)
            num_stages = min(num_stages, steps_per_split(num_in, block_k, split_k) + 1)
    if split_k == 1:  # the kernel writes `out` itself; no workspace, no counters
        partials, counters = out, out
    else:
        partials, counters = split_k_buffers(
            split_k, num_tiles, num_rows, num_out * (2 if gated else 1), x.device, counters
        )
    pdl = pdl_enabled(x, pdl)
    _small_linear_kernel[(num_tiles, split_k)](
        x, weight, x if norm_weight is None else norm_weight, out, partials, counters,
        num_rows, num_out, num_in, x.stride(0), weight.stride(0), out.stride(0), eps,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        NORM=norm_weight is not None, GATED=gated, ADD=add_to is not None, SPLIT_K=split_k,
        DOT_DTYPE=dot_dtype,
        DOT_PRECISION=precision,
        PDL=pdl,
        num_warps=num_warps, num_stages=num_stages, **launch_options(pdl),
    )
    return out
