"""Settings shared by the paged attention kernels."""

from __future__ import annotations

import torch
import triton.language as tl

LOG2E = 1.4426950408889634

_TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


def dot_settings(query: torch.Tensor) -> tuple[tl.dtype, str]:
    """(operand dtype, input precision) for the kernels' `tl.dot` calls.

    On a GPU the operands stay in the activations' dtype (exact fp32 products for fp32).
    Off the GPU the kernels run in the Triton interpreter, whose half-precision `tl.dot`
    is unreliable, so operands are widened to fp32 there.
    """
    if query.dtype not in _TL_DTYPES:
        raise ValueError(f"the kernels support fp32, bf16 and fp16 activations, got {query.dtype}")
    if not query.is_cuda:
        return tl.float32, "ieee"
    return _TL_DTYPES[query.dtype], "ieee" if query.dtype == torch.float32 else "tf32"
