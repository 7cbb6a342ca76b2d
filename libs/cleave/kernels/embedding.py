"""Token embedding lookup: one program per token copies its row of the table.

It exists for the decode step's first launch: as a Triton kernel with programmatic
dependent launch it lets the first layer's projection start (and load its first weight
tiles) while the rows are copied, where `F.embedding` ends every graph's first kernel before
the next one is scheduled. An id outside [0, vocab) gives a zero row, not a stray read.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from cleave.kernels.dispatch import CachedLauncher, Impl, use_triton
from cleave.kernels.pdl import launch_options, pdl_enabled, release_dependents, wait_for_producer

MAX_BLOCK = 4096  # row elements per loop step


@triton.jit
def _embedding_kernel(
    ids_ptr,  # [T]
    table_ptr,  # [V, H]
    out_ptr,  # [T, H]
    vocab_size,
    hidden,
    stride_ids,
    stride_table,
    stride_out,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    release_dependents(PDL)
    wait_for_producer(PDL)
    token_id = tl.load(ids_ptr + token * stride_ids).to(tl.int64)
    valid = (token_id >= 0) & (token_id < vocab_size)
    row = table_ptr + tl.where(valid, token_id, 0) * stride_table
    limit = tl.where(valid, hidden, 0)  # an invalid id reads nothing and writes zeros
    for start in tl.range(0, hidden, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        values = tl.load(row + cols, mask=cols < limit, other=0.0)
        tl.store(out_ptr + token * stride_out + cols, values, mask=cols < hidden)


_launcher = CachedLauncher(_embedding_kernel)


def embedding(input_ids: torch.Tensor, table: torch.Tensor, impl: Impl = "auto", pdl: bool = True) -> torch.Tensor:
    """table[input_ids]: [T] ids -> [T, H] rows (the Triton kernel writes zeros for an id
    outside the table, where the torch reference raises)."""
    if not use_triton(table, impl):
        return F.embedding(input_ids, table)
    if table.stride(-1) != 1:
        raise ValueError("the embedding table needs unit stride along its rows")
    num_tokens = input_ids.shape[0]
    vocab_size, hidden = table.shape
    out = torch.empty((num_tokens, hidden), dtype=table.dtype, device=table.device)
    if num_tokens == 0:
        return out
    block = min(MAX_BLOCK, triton.next_power_of_2(hidden))
    pdl = pdl_enabled(table, pdl)
    _launcher(
        (num_tokens,),
        (input_ids, table, out, vocab_size, hidden, input_ids.stride(0), table.stride(0), out.stride(0)),
        (block, pdl),
        max(1, min(8, block // 256)),
        **launch_options(pdl),
    )
    return out
