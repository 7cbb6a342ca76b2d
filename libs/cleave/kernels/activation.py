"""Gated-MLP activations (SiLU-and-mul, GeLU(tanh)-and-mul) and GeLU with bias.

Each Triton kernel reads its inputs once, computes in fp32 and rounds once on the store.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from cleave.kernels.dispatch import CachedLauncher, Impl, TileLaunch, tile_launch, use_triton

_SQRT_2_OVER_PI = tl.constexpr(0.7978845608028654)
_SQRT_HALF = tl.constexpr(0.7071067811865476)


def silu_and_mul_reference(x: torch.Tensor) -> torch.Tensor:
    # x: [T, 2I] = [gate | up] -> [T, I]
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def gelu_tanh_and_mul_reference(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


def gelu_bias_reference(x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    # x: [T, H], bias: [H]; exact (erf) GeLU of x + bias
    return F.gelu(x + bias)


@triton.jit
def _gated_act_kernel(
    x_ptr,  # [T, 2I] = [gate | up]
    out_ptr,  # [T, I]
    inter,
    x_row_stride,
    out_row_stride,
    USE_GELU_TANH: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)  # [BLOCK]
    mask = cols < inter
    x_row = x_ptr + row * x_row_stride
    gate = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_row + inter + cols, mask=mask, other=0.0).to(tl.float32)
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


def _gated(x: torch.Tensor, use_gelu_tanh: bool) -> torch.Tensor:
    x2 = _rows(x)  # [T, 2I]
    num_rows, inter = x2.shape[0], x2.shape[1] // 2
    out = torch.empty((num_rows, inter), dtype=x.dtype, device=x.device)
    launch: TileLaunch = tile_launch(num_rows, inter)
    _gated_act_launcher(
        launch.grid,
        (x2, out, inter, x2.stride(0), inter),
        (use_gelu_tanh, launch.block),
        launch.num_warps,
    )
    return out if x.dim() == 2 else out.view(*x.shape[:-1], inter)


def silu_and_mul(x: torch.Tensor, impl: Impl = "auto") -> torch.Tensor:
    """SiLU(gate) * up for x = [gate | up] along the last dimension: [T, 2I] -> [T, I]."""
    if not use_triton(x, impl):
        return silu_and_mul_reference(x)
    return _gated(x, use_gelu_tanh=False)


def gelu_tanh_and_mul(x: torch.Tensor, impl: Impl = "auto") -> torch.Tensor:
    """GeLU_tanh(gate) * up for x = [gate | up] along the last dimension: [T, 2I] -> [T, I]."""
    if not use_triton(x, impl):
        return gelu_tanh_and_mul_reference(x)
    return _gated(x, use_gelu_tanh=True)


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
