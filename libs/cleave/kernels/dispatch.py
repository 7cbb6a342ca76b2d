"""How a kernel op picks its implementation.

Every op's public function takes `impl: Impl = "auto"`: "auto" runs the Triton kernel when
the inputs live on a CUDA device and the torch reference otherwise; "triton" and "torch"
force one side. CPU tests force "triton" under TRITON_INTERPRET=1 (set by tests/conftest.py
before triton is imported, since `triton.jit` reads it at decoration time).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Literal

import torch
import triton

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


MAX_ROW_BLOCK = 65536  # widest row a row-wise kernel holds in registers at once


@dataclass(frozen=True)
class RowLaunch:
    """Launch shape of a row-wise kernel: `rows` rows of `block` columns per program."""

    grid: tuple[int]
    rows: int
    block: int
    num_warps: int


@functools.lru_cache(maxsize=4096)
def row_launch(num_rows: int, hidden: int) -> RowLaunch:
    """Pick rows per program, block width and warps for a row reduction over `hidden`.

    The whole row sits in registers (one HBM read); narrow rows are packed several to a
    program so each program still moves a few KiB.
    """
    block = triton.next_power_of_2(hidden)
    if block > MAX_ROW_BLOCK:
        raise ValueError(f"hidden size {hidden} exceeds the widest supported row ({MAX_ROW_BLOCK})")
    rows = max(1, min(16, 2048 // block, triton.next_power_of_2(num_rows)))
    elements = rows * block
    if elements >= 32768:
        num_warps = 32
    elif elements >= 8192:
        num_warps = 16
    elif elements >= 2048:
        num_warps = 8
    else:
        num_warps = 4
    return RowLaunch(grid=(triton.cdiv(num_rows, rows),), rows=rows, block=block, num_warps=num_warps)


@dataclass(frozen=True)
class TileLaunch:
    """Launch shape of an elementwise kernel over [rows, width]: one row x `block` columns."""

    grid: tuple[int, int]
    block: int
    num_warps: int


@functools.lru_cache(maxsize=4096)
def tile_launch(num_rows: int, width: int) -> TileLaunch:
    """Pick the column block and warps for an elementwise op over a [num_rows, width] grid.

    Rows go on grid axis 0 (no 65535 limit); 16-byte vectors per thread for 16-bit dtypes.
    """
    block = min(triton.next_power_of_2(width), 2048 if num_rows >= 1024 else 1024)
    num_warps = max(1, min(8, block // 256))
    return TileLaunch(grid=(num_rows, triton.cdiv(width, block)), block=block, num_warps=num_warps)
