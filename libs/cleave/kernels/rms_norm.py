"""RMSNorm, optionally fused with the residual add (residual updated in place)."""

from __future__ import annotations

import torch

from cleave.kernels.dispatch import Impl, use_triton


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # x: [T, H], weight: [H]
    variance = x.float().pow(2).mean(dim=-1, keepdim=True)
    return (x.float() * torch.rsqrt(variance + eps)).to(x.dtype) * weight


def fused_add_rms_norm_reference(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    # residual <- residual + x (in place); returns (rms_norm(residual) * weight, residual)
    residual.add_(x)
    return rms_norm_reference(residual, weight, eps), residual


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, impl: Impl = "auto") -> torch.Tensor:
    """RMSNorm over the last dimension."""
    use_triton(x, impl)
    return rms_norm_reference(x, weight, eps)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, impl: Impl = "auto"
) -> tuple[torch.Tensor, torch.Tensor]:
    """residual += x in place, then RMSNorm of the sum; returns (normed, residual)."""
    use_triton(x, impl)
    return fused_add_rms_norm_reference(x, residual, weight, eps)
