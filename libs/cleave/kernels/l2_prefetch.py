"""Pulling the next projection's weights into L2 from inside the kernel before it.

A decode step at tens of sequences alternates weight-streaming GEMMs with kernels that read
no weights (decode attention, SwiGLU). Those kernels leave HBM idle at their start (each
program's first loads are a chain of dependent reads) and end; the GEMM after them then
starts its own weight stream cold. Here every program of such a kernel first issues
`prefetch.global.L2::evict_last` for its share of the next GEMM's weight (fire and forget:
no registers wait on it), so HBM streams the weight into L2 in those idle moments and the
GEMM reads it from L2. Weights are never written during a step, so the prefetch may run
before the kernel's PDL wait.

`L2Prefetch` names up to two contiguous regions; `prefetch_regions` is the kernels' side.
On CPU tensors (the interpreter) nothing is prefetched: the kernels compile without it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

LINE_BYTES = 128  # one L2 line per prefetch instruction


@dataclass(frozen=True)
class L2Prefetch:
    """Contiguous tensors (at most two) that a kernel pulls into L2 for the kernel after it."""

    regions: tuple[torch.Tensor, ...] = ()

    def __post_init__(self) -> None:
        if len(self.regions) > 2:
            raise ValueError(f"L2Prefetch takes at most two regions, got {len(self.regions)}")
        for region in self.regions:
            if not region.is_contiguous():
                raise ValueError(f"L2Prefetch regions must be contiguous, got strides {region.stride()}")

    def launch_args(self, like: torch.Tensor) -> tuple[int, tuple, tuple]:
        """(REGIONS constexpr, the two region tensors, their sizes in lines) for a kernel
        whose tensors live with `like`; no regions off the GPU."""
        regions = [region for region in self.regions if region.numel() > 0] if like.is_cuda else []
        tensors = [*regions, *([like] * (2 - len(regions)))]
        lines = [triton.cdiv(region.numel() * region.element_size(), LINE_BYTES) for region in regions]
        return len(regions), tuple(tensors), (*lines, *([0] * (2 - len(lines))))


NO_PREFETCH = L2Prefetch()


@triton.jit
def _prefetch_lines(base_ptr, num_lines, part, num_parts, STEP: tl.constexpr):
    """Program `part` of `num_parts`: prefetch its share of `num_lines` 128-byte lines at base_ptr."""
    base = base_ptr.to(tl.pointer_type(tl.int8))
    per_part = tl.cdiv(num_lines, num_parts)
    first = part * per_part
    last = tl.minimum(first + per_part, num_lines)
    for start in range(first, last, STEP):
        lines = start + tl.arange(0, STEP)
        lines = tl.where(lines < last, lines, first)  # past the share: the first line again
        tl.inline_asm_elementwise(
            "mov.u32 $0, 0;\n\tprefetch.global.L2::evict_last [$1];",
            "=r,l",
            [base + lines.to(tl.int64) * 128],
            dtype=tl.int32,
            is_pure=False,
            pack=1,
        )


@triton.jit
def prefetch_regions(first_ptr, first_lines, second_ptr, second_lines, part, num_parts, REGIONS: tl.constexpr):
    """Program `part` of `num_parts` prefetches its share of each of the REGIONS (0-2) regions."""
    if REGIONS >= 1:
        _prefetch_lines(first_ptr, first_lines, part, num_parts, 64)
    if REGIONS >= 2:
        _prefetch_lines(second_ptr, second_lines, part, num_parts, 64)
