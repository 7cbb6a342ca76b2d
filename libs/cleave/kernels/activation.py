"""Gated-MLP activations (SiLU-and-mul, GeLU(tanh)-and-mul) and GeLU with bias."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from cleave.kernels.dispatch import Impl, use_triton


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


def silu_and_mul(x: torch.Tensor, impl: Impl = "auto") -> torch.Tensor:
    use_triton(x, impl)
    return silu_and_mul_reference(x)


def gelu_tanh_and_mul(x: torch.Tensor, impl: Impl = "auto") -> torch.Tensor:
    use_triton(x, impl)
    return gelu_tanh_and_mul_reference(x)


def gelu_bias(x: torch.Tensor, bias: torch.Tensor, impl: Impl = "auto") -> torch.Tensor:
    use_triton(x, impl)
    return gelu_bias_reference(x, bias)
