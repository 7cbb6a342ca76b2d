"""Grammar-constrained decoding: set the logits of disallowed tokens to -inf.

Structured outputs (`cleave.engine.grammar`) fill one allowed-token bitmask per constrained
sample every step, in xgrammar's layout: [R, W] int32 with W = ceil(V / 32), token v allowed
when bit v % 32 of word v // 32 is set (`(bitmask[r, v >> 5] >> (v & 31)) & 1`; bit 31 is the
sign bit of its int32 word). `apply_token_bitmask` applies the bitmasks of a whole batch in
one launch before sampling, each bitmask row to the logits row `rows` names.

The kernel's grid is (bitmask row, vocabulary block): each program loads one block of logits
as [BLOCK_WORDS, 32] (a word's 32 tokens along the fast axis) with the block's BLOCK_WORDS
words, expands the bits in registers and stores the block with -inf where a bit is clear.
The result is a new tensor: the kernel writes every row when each has a bitmask row, and
writes the listed rows into a clone of the logits otherwise.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from cleave.kernels.dispatch import CachedLauncher, Impl, use_triton

BITS = 32  # tokens per bitmask word
MAX_BLOCK_V = 4096  # tokens per program (a multiple of BITS)


def bitmask_words(vocab_size: int) -> int:
    """Words of a bitmask row over `vocab_size` tokens: ceil(V / 32)."""
    return -(-vocab_size // BITS)


def allowed_ids_to_bitmask(ids_per_row: Sequence[Sequence[int]], vocab_size: int) -> torch.Tensor:
    """A host [len(ids_per_row), ceil(V / 32)] int32 bitmask allowing the given token ids of each row."""
    num_words = bitmask_words(vocab_size)
    allowed = torch.zeros((len(ids_per_row), num_words * BITS), dtype=torch.bool)
    for row, ids in enumerate(ids_per_row):
        ids = torch.as_tensor(ids, dtype=torch.int64)
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
            raise ValueError(f"token ids of row {row} must lie in [0, {vocab_size})")
        allowed[row, ids] = True
    shifts = torch.arange(BITS, dtype=torch.int64)
    words = (allowed.view(len(ids_per_row), num_words, BITS).to(torch.int64) << shifts).sum(-1)  # [0, 2**32)
    return ((words + 2**31) % 2**32 - 2**31).to(torch.int32)  # bit 31 as the int32 sign bit


def _check(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor | None) -> None:
    if logits.dim() != 2 or bitmask.dim() != 2:
        raise ValueError(f"logits [B, V] and bitmask [R, W] must be 2-D, got {tuple(logits.shape)} and "
                         f"{tuple(bitmask.shape)}")
    if bitmask.dtype != torch.int32:
        raise ValueError(f"bitmask must be int32, got {bitmask.dtype}")
    if bitmask.shape[1] < bitmask_words(logits.shape[1]):
        raise ValueError(f"bitmask has {bitmask.shape[1]} words a row, {logits.shape[1]} tokens need "
                         f"{bitmask_words(logits.shape[1])}")
    if rows is None:
        if bitmask.shape[0] != logits.shape[0]:
            raise ValueError(f"without rows the bitmask needs one row per logits row: {bitmask.shape[0]} != "
                             f"{logits.shape[0]}")
    elif rows.dim() != 1 or rows.shape[0] != bitmask.shape[0] or rows.shape[0] > logits.shape[0]:
        raise ValueError(f"rows must be [R] with R = {bitmask.shape[0]} bitmask rows <= {logits.shape[0]} "
                         f"logits rows, got {tuple(rows.shape)}")
    elif rows.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"rows must be int32 or int64, got {rows.dtype}")
    for name, tensor in (("bitmask", bitmask), ("rows", rows)):
        if tensor is not None and tensor.device != logits.device:
            raise ValueError(f"{name} is on {tensor.device}, the logits on {logits.device}")


def apply_token_bitmask_reference(
    logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor | None = None
) -> torch.Tensor:
    """`apply_token_bitmask` in plain torch: unpack the words' bits, -inf where clear."""
    _check(logits, bitmask, rows)
    vocab_size = logits.shape[1]
    shifts = torch.arange(BITS, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1  # [R, W, 32]; >> is arithmetic, & 1 keeps bit 31
    disallowed = bits.flatten(1)[:, :vocab_size] == 0  # [R, V]
    if rows is None:
        return logits.masked_fill(disallowed, float("-inf"))
    out = logits.clone()
    out[rows] = logits[rows].masked_fill(disallowed, float("-inf"))
    return out


@triton.jit(do_not_specialize=["num_rows"])
def _token_bitmask_kernel(
    logits_ptr,  # [B, V]
    bitmask_ptr,  # [R, W] int32
    rows_ptr,  # [R]: the logits row of each bitmask row (HAS_ROWS)
    out_ptr,  # [B, V]
    num_rows,
    vocab_size,
    stride_logits,
    stride_bitmask,
    stride_out,
    HAS_ROWS: tl.constexpr,
    BLOCK_WORDS: tl.constexpr,
):
    mask_row = tl.program_id(0).to(tl.int64)
    if HAS_ROWS:
        row = tl.load(rows_ptr + mask_row).to(tl.int64)
    else:
        row = mask_row
    limit = tl.where((row >= 0) & (row < num_rows), vocab_size, 0)  # a row outside [0, B) is skipped
    words = tl.program_id(1) * BLOCK_WORDS + tl.arange(0, BLOCK_WORDS)  # [BLOCK_WORDS]
    bits = tl.arange(0, 32)
    cols = words[:, None] * 32 + bits[None, :]  # [BLOCK_WORDS, 32] token ids
    in_vocab = cols < limit
    packed = tl.load(bitmask_ptr + mask_row * stride_bitmask + words, mask=words * 32 < limit, other=0)
    allowed = ((packed[:, None] >> bits[None, :]) & 1) != 0  # arithmetic shift; & 1 keeps bit 31
    values = tl.load(logits_ptr + row * stride_logits + cols, mask=in_vocab)
    values = tl.where(allowed, values, float("-inf"))
    tl.store(out_ptr + row * stride_out + cols, values.to(out_ptr.dtype.element_ty), mask=in_vocab)


_launcher = CachedLauncher(_token_bitmask_kernel)


def apply_token_bitmask(
    logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor | None = None, impl: Impl = "auto"
) -> torch.Tensor:
    """Logits [B, V] with token v of row rows[r] set to -inf where bit v of bitmask row r is
    clear: a new tensor (the logits are not modified).

    bitmask: [R, W] int32 in xgrammar's layout (W >= ceil(V / 32); bits past V are ignored) on
    the logits' device. rows: [R] distinct int32/int64 logits rows; None means R == B, row r
    for bitmask row r. Rows not listed are copied unchanged. The Triton kernel skips a row
    outside [0, B), where the torch reference raises.
    """
    if not use_triton(logits, impl):
        return apply_token_bitmask_reference(logits, bitmask, rows)
    _check(logits, bitmask, rows)
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    if bitmask.stride(1) != 1:
        bitmask = bitmask.contiguous()
    num_rows, vocab_size = logits.shape
    num_masks = bitmask.shape[0]
    if rows is None:
        out = torch.empty((num_rows, vocab_size), dtype=logits.dtype, device=logits.device)
    else:
        out = logits.clone(memory_format=torch.contiguous_format)
        rows = rows.contiguous()
    if num_masks == 0 or vocab_size == 0:
        return out
    block_v = max(BITS, min(MAX_BLOCK_V, triton.next_power_of_2(vocab_size)))
    _launcher(
        (num_masks, triton.cdiv(vocab_size, block_v)),
        (logits, bitmask, bitmask if rows is None else rows, out, num_rows, vocab_size, logits.stride(0),
         bitmask.stride(0), out.stride(0)),
        (rows is not None, block_v // BITS),
        max(1, min(16, block_v // 256)),
    )
    return out
