"""LayerNorm, optionally fused with the residual add (residual updated in place).

The Triton kernel holds each row in registers, takes mean and variance in fp32 and rounds
once on the way out, as torch's own layer_norm does; with a residual it also writes the new
residual (rounded to its dtype) and normalises that rounded sum, so add+norm is one HBM pass.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from cleave.kernels.dispatch import CachedLauncher, Impl, RowLaunch, as_rows, row_launch, use_triton


def layer_norm_reference(
    x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float
) -> torch.Tensor:
    # x: [T, H], weight/bias: [H] or None
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)


def fused_add_layer_norm_reference(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    # residual <- residual + x (in place); returns (layer_norm(residual), residual)
    residual.add_(x)
    return layer_norm_reference(residual, weight, bias, eps), residual


@triton.jit(do_not_specialize=["num_rows"])
def _layer_norm_kernel(
    x_ptr,  # [T, H]
    residual_ptr,  # [T, H], read and written when HAS_RESIDUAL
    weight_ptr,  # [H]
    bias_ptr,  # [H]
    out_ptr,  # [T, H]
    num_rows,
    hidden,
    x_row_stride,
    residual_row_stride,
    out_row_stride,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)  # [ROWS]
    cols = tl.arange(0, BLOCK_H)  # [BLOCK_H]
    col_mask = cols < hidden
    mask = (rows[:, None] < num_rows) & col_mask[None, :]  # [ROWS, BLOCK_H]
    x = tl.load(x_ptr + rows[:, None] * x_row_stride + cols[None, :], mask=mask, other=0.0)
    if HAS_RESIDUAL:
        res_ptrs = residual_ptr + rows[:, None] * residual_row_stride + cols[None, :]
        summed = tl.load(res_ptrs, mask=mask, other=0.0).to(tl.float32) + x.to(tl.float32)
        x = summed.to(residual_ptr.dtype.element_ty)
        tl.store(res_ptrs, x, mask=mask)
    xf = x.to(tl.float32)
    mean = tl.sum(xf, axis=1) / hidden  # [ROWS]
    centered = tl.where(mask, xf - mean[:, None], 0.0)
    rstd = tl.math.rsqrt(tl.sum(centered * centered, axis=1) / hidden + eps)  # [ROWS]
    out = centered * rstd[:, None]
    if HAS_WEIGHT:
        out = out * tl.load(weight_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    if HAS_BIAS:
        out = out + tl.load(bias_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(
        out_ptr + rows[:, None] * out_row_stride + cols[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=mask,
    )


_layer_norm_launcher = CachedLauncher(_layer_norm_kernel)


def _launch(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
) -> torch.Tensor:
    hidden = x.shape[-1]
    x2, res2 = as_rows(x, residual)  # [T, H] each
    num_rows = x2.shape[0]
    out = torch.empty((num_rows, hidden), dtype=x.dtype, device=x.device)
    launch: RowLaunch = row_launch(num_rows, hidden)
    _layer_norm_launcher(
        launch.grid,
        (
            x2,
            res2,
            x2 if weight is None else weight,
            x2 if bias is None else bias,
            out,
            num_rows,
            hidden,
            x2.stride(0),
            res2.stride(0),
            hidden,
            eps,
        ),
        (residual is not None, weight is not None, bias is not None, launch.rows, launch.block),
        launch.num_warps,
    )
    return out.view(x.shape)


def layer_norm(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
    impl: Impl = "auto",
) -> torch.Tensor:
    """LayerNorm over the last dimension (weight and bias optional), output in x's dtype."""
    if not use_triton(x, impl):
        return layer_norm_reference(x, weight, bias, eps)
    return _launch(x, None, weight, bias, eps)


def fused_add_layer_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
    impl: Impl = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """residual += x in place, then LayerNorm of the sum; returns (normed, residual)."""
    if not use_triton(x, impl):
        return fused_add_layer_norm_reference(x, residual, weight, bias, eps)
    return _launch(x, residual, weight, bias, eps), residual
