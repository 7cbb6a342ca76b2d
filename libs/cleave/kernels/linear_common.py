"""What the tensor-core linear kernels share: their tile's rows and features, and the epilogue
(SwiGLU, rounding, residual add, store)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def linear_tile(
    x_ptr, w_ptr, block, num_rows, num_out, stride_x_row, stride_w_row, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """Rows [BLOCK_M] and features [BLOCK_N] of feature block `block`, their masks, the row
    pointers of x [BLOCK_M, 1] and of the weight [BLOCK_N, 1], and the offset from a gate row
    to its up row (gate_up weights: [2N, K])."""
    features = block * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.arange(0, BLOCK_M)
    x_rows = x_ptr + rows[:, None] * stride_x_row
    w_rows = w_ptr + features.to(tl.int64)[:, None] * stride_w_row
    up_offset = num_out.to(tl.int64) * stride_w_row
    return rows, features, rows < num_rows, features < num_out, x_rows, w_rows, up_offset


@triton.jit
def store_linear_output(
    acc, acc_up, out_ptr, rows, features, row_valid, feature_valid, stride_out_row,
    GATED: tl.constexpr, ADD: tl.constexpr,
):
    """Write the fp32 product acc [M, N] (GATED: silu(acc) * acc_up) to out [M, N], rounded
    to out's dtype; with ADD it is added, rounded, into out (the residual stream) instead."""
    if GATED:
        acc = acc / (1.0 + tl.exp(-acc)) * acc_up
    out_mask = row_valid[:, None] & feature_valid[None, :]
    out_ptrs = out_ptr + rows[:, None] * stride_out_row + features[None, :]
    result = acc.to(out_ptr.dtype.element_ty)
    if ADD:
        residual = tl.load(out_ptrs, mask=out_mask, other=0.0)
        result = (residual.to(tl.float32) + result.to(tl.float32)).to(out_ptr.dtype.element_ty)
    tl.store(out_ptrs, result, mask=out_mask)
