"""RMSNorm, optionally fused with the residual add (residual updated in place).

The Triton kernel reads each row once, reduces in fp32 and writes once; with a residual it
also writes the new residual, so add+norm costs one HBM pass (read x, residual; write
residual, out). Rounding follows the reference (HF Llama): the normalised row is cast to the
input dtype before the weight multiply, and the residual sum is rounded to the residual's
dtype before it is normalised.

Large fused add+norm calls (at least `RELOAD_MIN_ELEMENTS`) take a second kernel that does
not keep the row in registers across the reduction: it reads x and the residual once to
reduce (keeping them in L2), then reads them again from L2 to normalise and store. On an
H200 that streams at the copy rate where the one-pass kernel does not (16384 x 4096 bf16:
127.3 us vs 132.6 us, torch.compile 126.7 us; 16384 x 8192: 256.7 vs 265.2 us), while at
smaller sizes the one-pass kernel is faster (4096 x 4096: 32.5 vs 34.3 us);
bench/results/kernels/add_rms_norm_passes.md.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from cleave.kernels.dispatch import CachedLauncher, Impl, RowLaunch, as_rows, row_launch, use_triton
from cleave.kernels.pdl import launch_options, pdl_enabled, release_dependents, wait_for_producer
from cleave.kernels.row_norm import inverse_rms_reference


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # x: [T, H], weight: [H]
    return (x.float() * inverse_rms_reference(x, eps)).to(x.dtype) * weight


def fused_add_rms_norm_reference(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    # residual <- residual + x (in place); returns (rms_norm(residual) * weight, residual)
    residual.add_(x)
    return rms_norm_reference(residual, weight, eps), residual


@triton.jit(do_not_specialize=["num_rows"])
def _rms_norm_kernel(
    x_ptr,  # [T, H]
    residual_ptr,  # [T, H], read and written when HAS_RESIDUAL
    weight_ptr,  # [H]
    out_ptr,  # [T, H]
    num_rows,
    hidden,
    x_row_stride,
    residual_row_stride,
    out_row_stride,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_H: tl.constexpr,
    PDL: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)  # [ROWS]
    cols = tl.arange(0, BLOCK_H)  # [BLOCK_H]
    mask = (rows[:, None] < num_rows) & (cols[None, :] < hidden)  # [ROWS, BLOCK_H]
    # the weight is no kernel's output: load it before waiting on the previous kernel
    weight = tl.load(weight_ptr + cols, mask=cols < hidden, other=0.0).to(tl.float32)
    release_dependents(PDL)
    wait_for_producer(PDL)
    x = tl.load(x_ptr + rows[:, None] * x_row_stride + cols[None, :], mask=mask, other=0.0)
    if HAS_RESIDUAL:
        res_ptrs = residual_ptr + rows[:, None] * residual_row_stride + cols[None, :]
        summed = tl.load(res_ptrs, mask=mask, other=0.0).to(tl.float32) + x.to(tl.float32)
        x = summed.to(residual_ptr.dtype.element_ty)
        tl.store(res_ptrs, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = tl.math.rsqrt(tl.sum(xf * xf, axis=1) / hidden + eps)  # [ROWS]
    normed = (xf * rstd[:, None]).to(x.dtype).to(tl.float32)
    out = normed * weight[None, :]
    tl.store(
        out_ptr + rows[:, None] * out_row_stride + cols[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=mask,
    )


@triton.jit
def _add_rms_norm_reload_kernel(
    x_ptr,  # [T, H]
    residual_ptr,  # [T, H], updated in place
    weight_ptr,  # [H]
    out_ptr,  # [T, H]
    x_row_stride,
    residual_row_stride,
    out_row_stride,
    eps,
    HIDDEN: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    x_ptr += row * x_row_stride
    residual_ptr += row * residual_row_stride
    out_ptr += row * out_row_stride
    offsets = tl.arange(0, BLOCK)  # [BLOCK]
    squares = tl.zeros([BLOCK], dtype=tl.float32)
    for start in tl.range(0, HIDDEN, BLOCK):
        cols = start + offsets
        mask = cols < HIDDEN
        x = tl.load(x_ptr + cols, mask=mask, other=0.0, eviction_policy="evict_last")
        res = tl.load(residual_ptr + cols, mask=mask, other=0.0, eviction_policy="evict_last")
        summed = (res.to(tl.float32) + x.to(tl.float32)).to(res.dtype).to(tl.float32)
        squares += summed * summed
    rstd = tl.math.rsqrt(tl.sum(squares, axis=0) / HIDDEN + eps)
    for start in tl.range(0, HIDDEN, BLOCK):
        cols = start + offsets
        mask = cols < HIDDEN
        x = tl.load(x_ptr + cols, mask=mask, other=0.0, eviction_policy="evict_first")
        res = tl.load(residual_ptr + cols, mask=mask, other=0.0, eviction_policy="evict_first")
        weight = tl.load(weight_ptr + cols, mask=mask, other=0.0, eviction_policy="evict_last").to(tl.float32)
        summed = (res.to(tl.float32) + x.to(tl.float32)).to(res.dtype)
        tl.store(residual_ptr + cols, summed, mask=mask)
        normed = (summed.to(tl.float32) * rstd).to(summed.dtype).to(tl.float32)
        tl.store(out_ptr + cols, (normed * weight).to(out_ptr.dtype.element_ty), mask=mask)


_rms_norm_launcher = CachedLauncher(_rms_norm_kernel)
_reload_launcher = CachedLauncher(_add_rms_norm_reload_kernel)
RELOAD_MIN_ELEMENTS = 1 << 26  # fused add+norm calls this large take the reload kernel
RELOAD_BLOCK, RELOAD_WARPS = 2048, 16


def _launch(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float, pdl: bool
) -> torch.Tensor:
    hidden = x.shape[-1]
    x2, res2 = as_rows(x, residual)  # [T, H] each
    num_rows = x2.shape[0]
    out = torch.empty_like(x2)  # x2 is dense row-major or strided rows: either way out is contiguous
    if residual is not None and num_rows * hidden >= RELOAD_MIN_ELEMENTS:
        _reload_launcher(
            (num_rows,), (x2, res2, weight, out, x2.stride(0), res2.stride(0), hidden, eps),
            (hidden, min(RELOAD_BLOCK, triton.next_power_of_2(hidden))), RELOAD_WARPS,
        )
        return out if x.dim() == 2 else out.view(x.shape)
    launch: RowLaunch = row_launch(num_rows, hidden)
    pdl = pdl_enabled(x2, pdl)
    _rms_norm_launcher(
        launch.grid,
        (x2, res2, weight, out, num_rows, hidden, x2.stride(0), res2.stride(0), hidden, eps),
        (residual is not None, launch.rows, launch.block, pdl),
        launch.num_warps,
        **launch_options(pdl),
    )
    return out if x.dim() == 2 else out.view(x.shape)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, impl: Impl = "auto", pdl: bool = True
) -> torch.Tensor:
    """RMSNorm over the last dimension (`pdl`: see `cleave.kernels.pdl`)."""
    if not use_triton(x, impl):
        return rms_norm_reference(x, weight, eps)
    return _launch(x, None, weight, eps, pdl)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, impl: Impl = "auto",
    pdl: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """residual += x in place, then RMSNorm of the sum; returns (normed, residual)."""
    if not use_triton(x, impl):
        return fused_add_rms_norm_reference(x, residual, weight, eps)
    return _launch(x, residual, weight, eps, pdl), residual
