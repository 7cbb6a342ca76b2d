"""Pulling a later projection's weights into L2 while the GPU waits on a latency-bound kernel.

In a batch-1 decode step the attention is a chain of dependent reads of a few MB of KV: it
takes ~8 us a layer on an H200 during which HBM is mostly idle, and the GEMV after it (the
o projection, launched under PDL) has only its own 8 MB to stream beside it. The MLP's
gate_up projection after that is the step's largest read (67 MB a layer in Llama-3.2-1B).
Here the programs of a kernel that runs beside the attention issue `prefetch.global.L2`
for their share of regions of a later kernel's weight (fire and forget: no register waits
on a prefetch), so HBM streams those rows into L2 in the idle time and the later kernel
reads them from there. Weights are never written during a step, so the prefetch goes out
before the kernel's PDL wait.

An earlier form (prefetches from the attention and SwiGLU kernels at batch 32-64, where the
attention itself streams its KV at bandwidth) made those steps slower on an H200
(bench/results/decode/deferred/prefetch_ab.md); at batch 1 the attention does not.

`L2Prefetch` names up to three contiguous regions; `prefetch_regions` is the kernels' side.
On CPU tensors (the interpreter) nothing is prefetched: the kernels compile without it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

LINE_BYTES = 128  # one L2 line per prefetch instruction
MAX_REGIONS = 3


@dataclass(frozen=True)
class L2Prefetch:
    """Contiguous tensors (at most three) that a kernel pulls into L2 for kernels after it;
    `evict_last` marks the lines to outlive lines loaded with the default policy."""

    regions: tuple[torch.Tensor, ...] = ()
    evict_last: bool = False

    def __post_init__(self) -> None:
        if len(self.regions) > MAX_REGIONS:
            raise ValueError(f"L2Prefetch takes at most {MAX_REGIONS} regions, got {len(self.regions)}")
        for region in self.regions:
            if not region.is_contiguous():
                raise ValueError(f"L2Prefetch regions must be contiguous, got strides {tuple(region.stride())}")

    @property
    def num_bytes(self) -> int:
        return sum(region.numel() * region.element_size() for region in self.regions)

    def launch_args(self, like: torch.Tensor) -> tuple[tuple[torch.Tensor, ...], tuple[int, ...], int, bool]:
        """(the MAX_REGIONS region tensors, their sizes in lines, the REGIONS constexpr, EVICT_LAST)
        for a kernel whose tensors live with `like`; no regions off the GPU, unused slots
        filled with `like` and zero lines."""
        regions = [region for region in self.regions if region.numel() > 0] if like.is_cuda else []
        lines = [triton.cdiv(region.numel() * region.element_size(), LINE_BYTES) for region in regions]
        padding = MAX_REGIONS - len(regions)
        return (*regions, *([like] * padding)), (*lines, *([0] * padding)), len(regions), self.evict_last


NO_PREFETCH = L2Prefetch()


@triton.jit
def _prefetch_lines(base_ptr, num_lines, part, num_parts, STEP: tl.constexpr, EVICT_LAST: tl.constexpr):
    """Program `part` of `num_parts`: prefetch its share of `num_lines` 128-byte lines at base_ptr."""
    base = base_ptr.to(tl.pointer_type(tl.int8))
    per_part = tl.cdiv(num_lines, num_parts)
    first = part * per_part
    last = tl.minimum(first + per_part, num_lines)
    for start in range(first, last, STEP):
        lines = start + tl.arange(0, STEP)
        lines = tl.where(lines < last, lines, first)  # past the share: the first line again
        addresses = base + lines.to(tl.int64) * 128
        if EVICT_LAST:
            tl.inline_asm_elementwise("mov.u32 $0, 0;\n\tprefetch.global.L2::evict_last [$1];", "=r,l", [addresses],
                                      dtype=tl.int32, is_pure=False, pack=1)
        else:
            tl.inline_asm_elementwise("mov.u32 $0, 0;\n\tprefetch.global.L2 [$1];", "=r,l", [addresses],
                                      dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def prefetch_regions(first_ptr, first_lines, second_ptr, second_lines, third_ptr, third_lines, part, num_parts,
                     REGIONS: tl.constexpr, EVICT_LAST: tl.constexpr, STEP: tl.constexpr):
    """Program `part` of `num_parts` prefetches its share of each of the REGIONS (0-3) regions,
    STEP lines at a time (one a thread: the program's thread count)."""
    if REGIONS >= 1:
        _prefetch_lines(first_ptr, first_lines, part, num_parts, STEP, EVICT_LAST)
    if REGIONS >= 2:
        _prefetch_lines(second_ptr, second_lines, part, num_parts, STEP, EVICT_LAST)
    if REGIONS >= 3:
        _prefetch_lines(third_ptr, third_lines, part, num_parts, STEP, EVICT_LAST)
