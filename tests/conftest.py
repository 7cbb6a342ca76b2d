"""Test-wide setup: Triton kernels run under the interpreter when there is no GPU."""

import os

# triton.jit reads this when a kernel is decorated, so it must be set before any
# cleave.kernels module is imported.
if not os.environ.get("CUDA_VISIBLE_DEVICES_FORCE_GPU"):
    try:
        import torch

        _has_cuda = torch.cuda.is_available()
    except Exception:  # pragma: no cover
        _has_cuda = False
    if not _has_cuda:
        os.environ.setdefault("TRITON_INTERPRET", "1")
