"""An RMSNorm left to the kernels after the projection that reads it.

Once an RMSNorm's weight is folded into the projection after it
(`CausalLM.fold_norm_weights`: W[:, k] *= w[k]), the norm is a per-row scale, and a per-row
scale commutes with the projection: norm(x) @ W'^T = rstd(x) * (x @ W'^T). A decode batch on
cuBLAS GEMMs then needs no norm kernel: the GEMM reads the residual stream as it is, and the
kernel that consumes its product (decode attention for qkv, SwiGLU for gate_up) scales each
row by the inverse RMS of the residual row, which it reads itself (a few KiB per row, from L2).

`DeferredRMSNorm` says which rows to take the RMS of; `row_inverse_rms` is the kernels' side.
Rounding differs from the unfused norm by one step: the product is rounded once before it is
scaled, where the norm would round the normalised input before the product.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

MAX_BLOCK = 4096  # columns of the source row read per step (one step up to 4096)


@dataclass(frozen=True)
class DeferredRMSNorm:
    """Scale each row of a projection's product by the inverse RMS of `source`'s row.

    `source` is the residual stream the (unit-weight) norm would have read; row i of the
    product belongs to row i of `source`.
    """

    source: torch.Tensor  # [T, H], unit stride along H
    eps: float

    def __post_init__(self) -> None:
        if self.source.dim() != 2 or self.source.stride(-1) != 1:
            raise ValueError(
                f"DeferredRMSNorm.source must be a [T, H] tensor with unit stride along H, got shape "
                f"{tuple(self.source.shape)} and strides {self.source.stride()}"
            )

    @property
    def block(self) -> int:
        """The `BLOCK` argument of `row_inverse_rms` for this source."""
        return min(MAX_BLOCK, triton.next_power_of_2(self.source.shape[1]))


@dataclass(frozen=True)
class RowNormArgs:
    """A kernel's ROW_NORM arguments: the source tensor, its (hidden, row stride, eps) scalars
    and the NORM_BLOCK constexpr, or placeholders that the kernel never reads."""

    source: torch.Tensor
    scalars: tuple[int, int, float]
    block: int
    enabled: bool


def row_norm_args(row_norm: DeferredRMSNorm | None, num_rows: int, placeholder: torch.Tensor, what: str) -> RowNormArgs:
    """The launch arguments for `row_norm` applied to a `num_rows`-row product (`what` names
    the argument in the error when the row counts differ); `placeholder` stands in when None."""
    if row_norm is None:
        return RowNormArgs(placeholder, (0, 0, 0.0), 16, False)
    source = row_norm.source
    if source.shape[0] != num_rows:
        raise ValueError(f"{what}.source has {source.shape[0]} rows for {num_rows} rows of product")
    return RowNormArgs(source, (source.shape[1], source.stride(0), row_norm.eps), row_norm.block, True)


def inverse_rms_reference(source: torch.Tensor, eps: float) -> torch.Tensor:
    """[T, 1] float32: 1 / sqrt(mean(x^2) + eps) of each row of `source` [T, H]."""
    return torch.rsqrt(source.float().pow(2).mean(dim=-1, keepdim=True) + eps)


@triton.jit
def row_inverse_rms(row_ptr, hidden, eps, BLOCK: tl.constexpr):
    """fp32 inverse RMS of the `hidden` elements at `row_ptr`, read `BLOCK` at a time."""
    squares = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, hidden, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(row_ptr + cols, mask=cols < hidden, other=0.0).to(tl.float32)
        squares += x * x
    return tl.math.rsqrt(tl.sum(squares, axis=0) / hidden + eps)
