"""Static decode input buffers that captured graphs read; refilled in place every step.

A CUDA graph replays fixed device addresses, so every step's inputs are copied into the
same capacity-sized tensors and each bucket's graph was captured over leading slices of
them. `fill` copies the real rows and resets to padding only the rows (and block-table
columns) that a previous step left holding real data, all in one kernel launch on CUDA
(cleave.kernels.decode_inputs).
"""

from __future__ import annotations

import torch

from cleave.graphs.buckets import NULL_BLOCK_ID, PAD_POSITION, PAD_SEQ_LEN, PAD_SLOT_ID, PAD_TOKEN_ID
from cleave.kernels.decode_inputs import DecodeInputs, InputPadding, fill_decode_inputs
from cleave.kernels.dispatch import Impl
from cleave.kv.metadata import AttentionMetadata, zeroed_split_counters

PADDING = InputPadding(PAD_TOKEN_ID, PAD_POSITION, PAD_SLOT_ID, PAD_SEQ_LEN, NULL_BLOCK_ID)


class StaticDecodeBuffers:
    """Capacity-sized decode inputs (one query token per sequence) for graph capture/replay.

    Attributes:
        input_ids: [max_batch_size] int64 token ids.
        positions: [max_batch_size] int64 positions.
        slot_mapping: [max_batch_size] int64 KV slot of each new token.
        seq_lens: [max_batch_size] int32 context length including the new token.
        block_tables: [max_batch_size, max_blocks_per_seq] int32.
        query_start_loc: [max_batch_size + 1] int32, constant 0..max_batch_size (one token each).
        split_counters: int32 zeros (`cleave.kv.metadata.zeroed_split_counters`), the scratch of the
            decode attention and split-K linear kernels (left zeroed by every launch), so
            graphs carry no memset for it.
        window: the slots and block tables of the window tables, as `slot_mapping` and
            `block_tables` (`window_tables=True`: a paired cache, cleave.kv.groups), else None.
    """

    def __init__(self, max_batch_size: int, max_blocks_per_seq: int, block_size: int, device: torch.device | str,
                 window_tables: bool = False) -> None:
        self.max_batch_size = max_batch_size
        self.max_blocks_per_seq = max_blocks_per_seq
        self.block_size = block_size
        self.input_ids = torch.full((max_batch_size,), PAD_TOKEN_ID, dtype=torch.int64, device=device)
        self.positions = torch.full((max_batch_size,), PAD_POSITION, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((max_batch_size,), PAD_SLOT_ID, dtype=torch.int64, device=device)
        self.seq_lens = torch.full((max_batch_size,), PAD_SEQ_LEN, dtype=torch.int32, device=device)
        self.block_tables = torch.full(
            (max_batch_size, max_blocks_per_seq), NULL_BLOCK_ID, dtype=torch.int32, device=device
        )
        self.query_start_loc = torch.arange(max_batch_size + 1, dtype=torch.int32, device=device)
        self.split_counters = zeroed_split_counters(max_batch_size, device)
        self._static = DecodeInputs(self.input_ids, self.positions, self.slot_mapping, self.seq_lens, self.block_tables)
        self.window: DecodeInputs | None = None
        if window_tables:  # ids, positions and lengths shared: the second fill rewrites the same values
            self.window = DecodeInputs(self.input_ids, self.positions, torch.full_like(self.slot_mapping, PAD_SLOT_ID),
                                       self.seq_lens, torch.full_like(self.block_tables, NULL_BLOCK_ID))
        # Extent of real data left by the last fill: rows [0, dirty_rows), columns [0, dirty_width).
        self.dirty_rows = 0
        self.dirty_width = 0

    @property
    def max_seq_len(self) -> int:
        """Context capacity: what graphs are captured for, so the decode grid is static."""
        return self.max_blocks_per_seq * self.block_size

    def metadata(self, bucket: int) -> AttentionMetadata:
        """Views of the first `bucket` rows, as the graph for `bucket` reads them."""
        metadata = AttentionMetadata(
            slot_mapping=self.slot_mapping[:bucket],
            query_start_loc=self.query_start_loc[: bucket + 1],
            seq_lens=self.seq_lens[:bucket],
            block_tables=self.block_tables[:bucket],
            max_query_len=1,
            max_seq_len=self.max_seq_len,
            split_counters=self.split_counters,
        )
        if self.window is not None:
            metadata.window = metadata.over_tables(self.window.slot_mapping[:bucket], self.window.block_tables[:bucket])
        return metadata

    def fill(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        metadata: AttentionMetadata,
        impl: Impl = "auto",
        pdl: bool = True,
    ) -> None:
        """Copy a decode batch into rows [0, batch) and leave every other row as padding
        (one kernel launch on CUDA).

        `input_ids`, `positions`: [batch]; `metadata` holds one query token per sequence.
        """
        batch_size = input_ids.shape[0]
        width = metadata.block_tables.shape[1]
        if batch_size > self.max_batch_size:
            raise ValueError(f"batch of {batch_size} exceeds the graph capacity of {self.max_batch_size}")
        if width > self.max_blocks_per_seq:
            raise ValueError(
                f"block tables of {width} blocks exceed the graph capacity of {self.max_blocks_per_seq}; "
                "raise max_blocks_per_seq (max model length / block size)"
            )
        source = DecodeInputs(input_ids, positions, metadata.slot_mapping, metadata.seq_lens, metadata.block_tables)
        fill_decode_inputs(source, self._static, PADDING, self.dirty_rows, self.dirty_width, impl, pdl)
        if self.window is not None:
            window = metadata.window
            if window is None:
                raise ValueError("the decode graphs were captured with window tables; the batch has none")
            source = DecodeInputs(input_ids, positions, window.slot_mapping, metadata.seq_lens, window.block_tables)
            fill_decode_inputs(source, self.window, PADDING, self.dirty_rows, self.dirty_width, impl, pdl)
        self.dirty_rows = batch_size
        self.dirty_width = width

    def reset(self) -> None:
        """Return every row to padding (before capture, so warm-up runs touch no real state)."""
        self.input_ids.fill_(PAD_TOKEN_ID)
        self.positions.fill_(PAD_POSITION)
        self.slot_mapping.fill_(PAD_SLOT_ID)
        self.seq_lens.fill_(PAD_SEQ_LEN)
        self.block_tables.fill_(NULL_BLOCK_ID)
        if self.window is not None:
            self.window.slot_mapping.fill_(PAD_SLOT_ID)
            self.window.block_tables.fill_(NULL_BLOCK_ID)
        self.dirty_rows = 0
        self.dirty_width = 0
