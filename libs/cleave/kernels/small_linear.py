"""Linear layers for decode-sized batches (1-16 rows): weight-streaming Triton GEMV.

At a handful of rows a projection is a pass over its weight matrix, so time is bytes of
weight / HBM bandwidth. Each program owns `BLOCK_N` output features and streams their
weight rows (contiguous along K in `nn.Linear`'s [N, K] layout) through a pipelined loop;
the activations are padded to 16 rows for `tl.dot`. `gated=True` fuses SwiGLU: the weight
is gate_up ([2I, K], gate rows first) and each program computes both halves of its
features and writes silu(gate) * up, so the [M, 2I] intermediate never reaches HBM.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from cleave.kernels.dispatch import Impl, use_triton

MAX_ROWS = 16


@triton.jit
def _small_linear_kernel(
    x_ptr,  # [M, K]
    w_ptr,  # [N, K] (gated: [2N, K], gate rows then up rows)
    out_ptr,  # [M, N]
    num_rows,
    num_out,  # N: output features
    num_in,  # K
    stride_x_row,
    stride_w_row,
    stride_out_row,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GATED: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    features = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    rows = tl.arange(0, BLOCK_M)  # [BLOCK_M]
    feature_valid = features < num_out
    row_valid = rows < num_rows
    w_rows = w_ptr + features.to(tl.int64)[:, None] * stride_w_row  # [BLOCK_N, 1]
    up_offset = num_out.to(tl.int64) * stride_w_row
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, num_in, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)  # [BLOCK_K]
        col_valid = cols < num_in
        x = tl.load(
            x_ptr + rows[:, None] * stride_x_row + cols[None, :], mask=row_valid[:, None] & col_valid[None, :], other=0.0
        )  # [BLOCK_M, BLOCK_K]
        w_mask = feature_valid[:, None] & col_valid[None, :]
        w = tl.load(w_rows + cols[None, :], mask=w_mask, other=0.0)  # [BLOCK_N, BLOCK_K]
        acc = tl.dot(x, tl.trans(w), acc, input_precision=DOT_PRECISION)
        if GATED:
            w_up = tl.load(w_rows + up_offset + cols[None, :], mask=w_mask, other=0.0)
            acc_up = tl.dot(x, tl.trans(w_up), acc_up, input_precision=DOT_PRECISION)
    if GATED:
        acc = acc / (1.0 + tl.exp(-acc)) * acc_up
    out_mask = row_valid[:, None] & feature_valid[None, :]
    tl.store(out_ptr + rows[:, None] * stride_out_row + features[None, :], acc.to(out_ptr.dtype.element_ty), mask=out_mask)


def small_linear_reference(x: torch.Tensor, weight: torch.Tensor, gated: bool = False) -> torch.Tensor:
    """x [M, K] @ weight.T; gated: silu(gate) * up of the [M, 2I] product, in fp32 then cast."""
    out = F.linear(x.float(), weight.float())
    if gated:
        gate, up = out.chunk(2, dim=-1)
        out = F.silu(gate) * up
    return out.to(x.dtype)


def small_linear(
    x: torch.Tensor,  # [M, K], M <= MAX_ROWS
    weight: torch.Tensor,  # [N, K] (gated: [2I, K])
    gated: bool = False,
    impl: Impl = "auto",
    block_n: int = 16,
    block_k: int = 256,
    num_warps: int = 4,
    num_stages: int = 4,
) -> torch.Tensor:  # [M, N] (gated: [M, I])
    """x @ weight.T for at most MAX_ROWS rows (gated: fused SwiGLU of gate_up)."""
    if not use_triton(x, impl):
        return small_linear_reference(x, weight, gated)
    num_rows, num_in = x.shape
    if num_rows > MAX_ROWS:
        raise ValueError(f"small_linear takes at most {MAX_ROWS} rows, got {num_rows}")
    if weight.shape[1] != num_in or x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError(f"need x [M, {weight.shape[1]}] and weight [N, K] contiguous along K, got {tuple(x.shape)}")
    num_out = weight.shape[0] // 2 if gated else weight.shape[0]
    out = torch.empty((num_rows, num_out), dtype=x.dtype, device=x.device)
    if num_rows == 0:
        return out
    _small_linear_kernel[(triton.cdiv(num_out, block_n),)](
        x, weight, out, num_rows, num_out, num_in, x.stride(0), weight.stride(0), out.stride(0),
        BLOCK_M=MAX_ROWS, BLOCK_N=block_n, BLOCK_K=block_k, GATED=gated,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        num_warps=num_warps, num_stages=num_stages,
    )
    return out
