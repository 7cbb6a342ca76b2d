"""The epilogue the tensor-core linear kernels share: SwiGLU, rounding, residual add, store."""

from __future__ import annotations

import triton
import triton.language as tl


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
