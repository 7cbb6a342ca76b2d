"""Test-wide setup: Triton kernels run under the interpreter when there is no GPU."""

import os

import torch

# triton.jit reads TRITON_INTERPRET when a kernel is decorated, so it must be set before any
# cleave.kernels module is imported; CPU tests force impl="triton" to exercise the kernels.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
