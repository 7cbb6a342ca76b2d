"""Batch-size buckets for CUDA-graph capture and the padding that fills a bucket.

A decode batch of `n` sequences replays the graph of the smallest captured bucket
`>= n`; rows `n..bucket-1` are padding. A padding row can never touch real state: its
slot is PAD_SLOT_ID (the KV write skips it), its context length is 0 (attention reads no
key, not even from block 0) and its block table points only at the null block 0, which
the block pool reserves and never hands out.
"""

from __future__ import annotations

import bisect

from cleave.kv.block_pool import NULL_BLOCK_ID
from cleave.kv.metadata import PAD_SLOT_ID

PAD_TOKEN_ID = 0
PAD_POSITION = 0
PAD_SEQ_LEN = 0

__all__ = [
    "NULL_BLOCK_ID",
    "PAD_POSITION",
    "PAD_SEQ_LEN",
    "PAD_SLOT_ID",
    "PAD_TOKEN_ID",
    "batch_size_buckets",
    "select_bucket",
]

# (bucket step, largest bucket taken with that step): 1, 2, 4, 8, then 16..32 by 8,
# 48..128 by 16, 160..256 by 32, then by 64. Padding wastes at most ~1/3 of a step.
_STEPS: tuple[tuple[int, int], ...] = ((8, 32), (16, 128), (32, 256))
_LARGE_STEP = 64


def batch_size_buckets(max_batch_size: int) -> list[int]:
    """Ascending batch sizes to capture, ending exactly at `max_batch_size`."""
    if max_batch_size < 1:
        raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
    sizes = [1, 2, 4, 8]
    for step, limit in _STEPS:
        sizes.extend(range(sizes[-1] + step, limit + 1, step))
    while sizes[-1] < max_batch_size:
        sizes.append(sizes[-1] + _LARGE_STEP)
    buckets = [size for size in sizes if size < max_batch_size]
    return buckets + [max_batch_size]


def select_bucket(buckets: list[int], batch_size: int) -> int | None:
    """Smallest bucket that holds `batch_size` rows, or None when it exceeds the largest."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    index = bisect.bisect_left(buckets, batch_size)
    return buckets[index] if index < len(buckets) else None
