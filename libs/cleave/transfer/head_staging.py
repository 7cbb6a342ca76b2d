"""Sending a receiver the slice of the KV heads it holds.

A decode rank of a tensor-parallel pool holds some of the model's KV heads; the prefill
worker's cache may hold more (prefill TP=1 -> decode TP=2: each decode rank gets half of
them; 2 -> 4 likewise). `cleave.transfer.layout.head_slice` finds the slice at connect; a
sender told it (`BaseKVSender.select_heads`) gathers each run's blocks, those heads only,
into a contiguous staging cache `[L, 2, n, BS, h, D]` of the transfer's own, and its
transport moves the staging's blocks 0..n-1 as it moves any cache's (the block copy of CUDA
IPC needs whole contiguous blocks, which a head slice of a cache is not). The gather is one
device copy per run, ordered after the KV's producer like the transport's own work.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from cleave.transfer.streams import Ready, order_after
from cleave.transfer.tensors import device_index


class HeadStaging:
    """The staging cache of one transfer's head-sliced blocks.

    Args:
        heads: the slice of the source cache's head axis the receiver holds.
        num_blocks: the blocks the transfer moves.
    """

    def __init__(self, heads: slice, num_blocks: int) -> None:
        self.heads = heads
        self.num_blocks = num_blocks
        self._staged: torch.Tensor | None = None
        self.block_ids = list(range(num_blocks))  # the staging's blocks, in the transfer's order
        self._index: torch.Tensor | None = None  # the source block ids on the device
        self._index_ids: tuple[int, ...] = ()

    def stage(self, layers: range, cache: torch.Tensor, src_ids: Sequence[int], ready: Ready) -> tuple[torch.Tensor, Ready]:
        """Gather `layers` of blocks `src_ids` (heads `self.heads`) into the staging cache;
        returns it and what its transport orders after (the current stream on CUDA)."""
        if self._staged is None:
            num_layers, _, _, block_size, _, head_dim = cache.shape
            num_heads = len(range(cache.shape[4])[self.heads])
            self._staged = torch.empty((num_layers, 2, self.num_blocks, block_size, num_heads, head_dim),
                                       dtype=cache.dtype, device=cache.device)
        if self._index is None or self._index_ids != tuple(src_ids):  # the same blocks for every run
            self._index_ids = tuple(src_ids)
            self._index = device_index(src_ids, cache.device)
        index = self._index
        if cache.is_cuda:
            order_after(torch.cuda.current_stream(cache.device), ready, cache.device)
            ready = "current_stream"
        run = slice(layers.start, layers.stop)
        self._staged[run] = cache[run].index_select(2, index)[:, :, :, :, self.heads]
        return self._staged, ready
