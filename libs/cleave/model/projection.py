"""An `nn.Linear`'s product, through the register GEMV for a single row on CUDA.

Models without the fused decode layouts (`cleave.model.fused_decode`: mixture-of-experts,
attention sinks) still run a batch-1 decode step's projections one row at a time; there
`small_linear`'s register GEMV streams the weight at a higher share of HBM bandwidth than a
cuBLAS GEMM of one row, and starts its weight stream under the previous kernel's tail
(programmatic dependent launch), adding a bias as `nn.Linear` does (gpt-oss's). Any subclass
with a forward of its own keeps it (a tensor-parallel row projection sums across ranks).
"""

from __future__ import annotations

import torch
from torch import nn

from cleave.kernels.dispatch import Impl, use_triton
from cleave.kernels.gemv import AUTO_MAX_ROWS as GEMV_AUTO_MAX_ROWS
from cleave.kernels.small_linear import small_linear


def project(linear: nn.Linear, x: torch.Tensor, impl: Impl = "auto", pdl: bool = True) -> torch.Tensor:
    """linear(x) for x [T, K] -> [T, N]."""
    if (type(linear) is nn.Linear and 0 < x.shape[0] <= GEMV_AUTO_MAX_ROWS and x.is_cuda
            and x.stride(-1) == 1 and x.dtype == linear.weight.dtype and use_triton(x, impl)):
        return small_linear(x, linear.weight, bias=linear.bias, pdl=pdl)
    return linear(x)
