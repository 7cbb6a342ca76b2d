"""How a kernel op picks its implementation.

Every op's public function takes `impl: Impl = "auto"`: "auto" runs the Triton kernel when
the inputs live on a CUDA device and the torch reference otherwise; "triton" and "torch"
force one side. CPU tests force "triton" under TRITON_INTERPRET=1 (set by tests/conftest.py
before triton is imported, since `triton.jit` reads it at decoration time).
"""

from __future__ import annotations

from typing import Literal

import torch

Impl = Literal["auto", "triton", "torch"]


def use_triton(tensor: torch.Tensor, impl: Impl = "auto") -> bool:
    """Whether an op called on `tensor` with `impl` should run its Triton kernel."""
    if impl == "triton":
        return True
    if impl == "torch":
        return False
    if impl != "auto":
        raise ValueError(f"impl must be 'auto', 'triton' or 'torch', got {impl!r}")
    return tensor.is_cuda
