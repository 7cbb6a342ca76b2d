"""Gated-MLP activations (SiLU-and-mul, GeLU(tanh)-and-mul) and GeLU with bias.

Each Triton kernel reads its inputs once, computes in fp32 and rounds once on the store.
The gated ones can also apply a deferred RMSNorm (`cleave.kernels.row_norm`): gate and up
are the product of the unnormalised residual stream with norm-folded weights, and each row
is scaled by the residual row's inverse RMS before the activation.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from cleave.kernels.dispatch import CachedLauncher, Impl, TileLaunch, tile_launch, use_triton
from cleave.kernels.pdl import launch_options, pdl_enabled, release_dependents, wait_for_producer
from cleave.kernels.row_norm import DeferredRMSNorm, inverse_rms_reference, row_inverse_rms, row_norm_args

_SQRT_2_OVER_PI = tl.constexpr(0.7978845608028654)
_SQRT_HALF = tl.constexpr(0.7071067811865476)


def _gate_up(x: torch.Tensor, row_norm: DeferredRMSNorm | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The halves of x = [gate | up]; with `row_norm`, in fp32 and scaled by its rows' inverse RMS."""
    if row_norm is not None:
        x = x.float() * inverse_rms_reference(row_norm.source, row_norm.eps)
    return x.chunk(2, dim=-1)


def silu_and_mul_reference(x: torch.Tensor, row_norm: DeferredRMSNorm | None = None) -> torch.Tensor:
    # x: [T, 2I] = [gate | up] -> [T, I]
    gate, up = _gate_up(x, row_norm)
    return (F.silu(gate) * up).to(x.dtype)


def gelu_tanh_and_mul_reference(x: torch.Tensor, row_norm: DeferredRMSNorm | None = None) -> torch.Tensor:
    gate, up = _gate_up(x, row_norm)
    return (F.gelu(gate, approximate="tanh") * up).to(x.dtype)


def gelu_bias_reference(x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    # x: [T, H], bias: [H]; exact (erf) GeLU of x + bias
    return F.gelu(x + bias)


@triton.jit
def _gated_act_kernel(
    x_ptr,  # [T, 2I] = [gate | up]
    out_ptr,  # [T, I]
    norm_src_ptr,  # ROW_NORM: [T, H] rows whose inverse RMS scales gate and up
    inter,
    x_row_stride,
    out_row_stride,
    norm_hidden,
    norm_row_stride,
    norm_eps,
    USE_GELU_TANH: tl.constexpr,
    BLOCK: tl.constexpr,
    ROW_NORM: tl.constexpr,
    NORM_BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_producer(PDL)
    release_dependents(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)  # [BLOCK]
    mask = cols < inter
    x_row = x_ptr + row * x_row_stride
    gate = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_row + inter + cols, mask=mask, other=0.0).to(tl.float32)
    if ROW_NORM:
        rstd = row_inverse_rms(norm_src_ptr + row * norm_row_stride, norm_hidden, norm_eps, NORM_BLOCK)
        gate *= rstd
        up *= rstd
    if USE_GELU_TANH:
        # 0.5 * g * (1 + tanh(u)) == g * sigmoid(2u)
        inner = _SQRT_2_OVER_PI * (gate + 0.044715 * gate * gate * gate)
        act = gate * tl.sigmoid(2.0 * inner)
    else:
        act = gate * tl.sigmoid(gate)
    out = act * up
    tl.store(out_ptr + row * out_row_stride + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _gelu_bias_kernel(
    x_ptr,  # [T, H]
    bias_ptr,  # [H]
    out_ptr,  # [T, H]
    hidden,
    x_row_stride,
    out_row_stride,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)  # [BLOCK]
    mask = cols < hidden
    x = tl.load(x_ptr + row * x_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    x = x + tl.load(bias_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    out = 0.5 * x * (1.0 + tl.math.erf(x * _SQRT_HALF))
    tl.store(out_ptr + row * out_row_stride + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


_gated_act_launcher = CachedLauncher(_gated_act_kernel)
_gelu_bias_launcher = CachedLauncher(_gelu_bias_kernel)


def _rows(x: torch.Tensor) -> torch.Tensor:
    # [..., W] -> [T, W] with unit stride along W (a view whenever possible)
    x2 = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def _gated(x: torch.Tensor, use_gelu_tanh: bool, row_norm: DeferredRMSNorm | None, pdl: bool) -> torch.Tensor:
    x2 = _rows(x)  # [T, 2I]
    num_rows, inter = x2.shape[0], x2.shape[1] // 2
    out = torch.empty((num_rows, inter), dtype=x.dtype, device=x.device)
    launch: TileLaunch = tile_launch(num_rows, inter)
    norm = row_norm_args(row_norm, num_rows, x2, "row_norm")
    pdl = pdl_enabled(x2, pdl)
    _gated_act_launcher(
        launch.grid,
        (x2, out, norm.source, inter, x2.stride(0), inter, *norm.scalars),
        (use_gelu_tanh, launch.block, norm.enabled, norm.block, pdl),
        launch.num_warps,
        **launch_options(pdl),
    )
    return out if x.dim() == 2 else out.view(*x.shape[:-1], inter)


def silu_and_mul(
    x: torch.Tensor, impl: Impl = "auto", row_norm: DeferredRMSNorm | None = None, pdl: bool = True
) -> torch.Tensor:
    """SiLU(gate) * up for x = [gate | up] along the last dimension: [T, 2I] -> [T, I]; with
    `row_norm` gate and up are first scaled by its rows' inverse RMS (2-D x only); `pdl`: see
    `cleave.kernels.pdl`."""
    if not use_triton(x, impl):
        return silu_and_mul_reference(x, row_norm)
    return _gated(x, use_gelu_tanh=False, row_norm=row_norm, pdl=pdl)


def gelu_tanh_and_mul(
    x: torch.Tensor, impl: Impl = "auto", row_norm: DeferredRMSNorm | None = None, pdl: bool = True
) -> torch.Tensor:
    """GeLU_tanh(gate) * up for x = [gate | up] along the last dimension: [T, 2I] -> [T, I]; with
    `row_norm` gate and up are first scaled by its rows' inverse RMS (2-D x only); `pdl`: see
    `cleave.kernels.pdl`."""
    if not use_triton(x, impl):
        return gelu_tanh_and_mul_reference(x, row_norm)
    return _gated(x, use_gelu_tanh=True, row_norm=row_norm, pdl=pdl)


def gelu_bias(x: torch.Tensor, bias: torch.Tensor, impl: Impl = "auto") -> torch.Tensor:
    """Exact (erf) GeLU of x + bias: [T, H], [H] -> [T, H]."""
    if not use_triton(x, impl):
        return gelu_bias_reference(x, bias)
    x2 = _rows(x)  # [T, H]
    num_rows, hidden = x2.shape
    out = torch.empty((num_rows, hidden), dtype=x.dtype, device=x.device)
    launch: TileLaunch = tile_launch(num_rows, hidden)
    _gelu_bias_launcher(
        launch.grid, (x2, bias, out, hidden, x2.stride(0), hidden), (launch.block,), launch.num_warps
    )
    return out if x.dim() == 2 else out.view(x.shape)
