"""Attention metadata: how one flattened batch maps onto the paged KV cache.

A step's batch is flattened: the new tokens of every sequence are concatenated into one
`[num_tokens]` vector (prefill chunks and single decode tokens alike). For sequence `b`
the new tokens are `query_start_loc[b]:query_start_loc[b + 1]`; they are the *last*
`query_len` tokens of a context of `seq_lens[b]` tokens, so query `i` of sequence `b` sits
at position `seq_lens[b] - query_len_b + i` and sees keys `0..position` (causal).

KV cache layout (one tensor for the whole model, so a layer or a block is one slice):
    kv_cache: [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]
    kv_cache[layer][0] is K, kv_cache[layer][1] is V.
A slot is `block_id * block_size + offset`; `slot_mapping[t] == -1` marks a padding
token whose K/V must not be written anywhere.

A cache that pairs full-attention layers with sliding-window ones (`cleave.kv.groups`) has
`num_slots` (not `num_layers`) layer slots, and the sliding layers read and write the pages
of the sequences' window tables: `metadata.window` is the same batch over those tables
(its own `slot_mapping` and `block_tables`, every other field shared).
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass

import torch

PAD_SLOT_ID = -1
MAX_KV_HEADS = 128  # KV heads per layer the split counters are sized for
# Feature blocks of the widest split-K projection (cleave.kernels.splitk_linear), e.g. a
# 28672-wide gate_up at 64 features per block.
MIN_SPLIT_COUNTERS = 1024


def zeroed_split_counters(max_num_seqs: int, device: torch.device | str) -> torch.Tensor:
    """Zeroed int32 `AttentionMetadata.split_counters` for batches of up to `max_num_seqs`
    sequences: max_num_seqs x MAX_KV_HEADS, at least MIN_SPLIT_COUNTERS. A batch given none
    makes every attention layer zero counters of its own (a memset launch each)."""
    return torch.zeros(max(max_num_seqs * MAX_KV_HEADS, MIN_SPLIT_COUNTERS), dtype=torch.int32, device=device)


@dataclass
class AttentionMetadata:
    """Device tensors (and a few host ints) describing one forward's attention layout.

    Attributes:
        slot_mapping: [num_tokens] int64 slot of each new token, PAD_SLOT_ID for padding.
        query_start_loc: [num_seqs + 1] int32 prefix sums of query lengths.
        seq_lens: [num_seqs] int32 context length of each sequence *including* new tokens.
        block_tables: [num_seqs, max_blocks_per_seq] int32 block ids (unused tail: 0).
        max_query_len: host int, longest query in the batch (1 for a pure decode step).
        max_seq_len: host int, an upper bound on seq_lens (for CUDA graphs: the capacity).
        split_counters: optional int32 scratch of zeros that the decode attention kernel (at
            least num_seqs x num_kv_heads) and the split-K linear kernel (one per feature
            block) use, one launch after another, to find each output's last split; each
            launch leaves them zeroed. Without it the kernels allocate zeroed counters per call.
        window: the batch over the sequences' window tables (paired caches only), else None.
        num_decode_seqs: host int, how many of the batch's first sequences feed one token
            each (the scheduler puts decodes first; 0 where not counted, as in the CUDA
            graphs' buffers); a mixed batch may attend them with the decode kernel (`leading`).
    """

    slot_mapping: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    max_query_len: int
    max_seq_len: int
    split_counters: torch.Tensor | None = None
    window: AttentionMetadata | None = None
    num_decode_seqs: int = 0

    def over_tables(self, slot_mapping: torch.Tensor, block_tables: torch.Tensor) -> AttentionMetadata:
        """The same batch over other block tables (a window group's): only the slots and
        tables differ."""
        return AttentionMetadata(slot_mapping, self.query_start_loc, self.seq_lens, block_tables,
                                 self.max_query_len, self.max_seq_len, self.split_counters,
                                 num_decode_seqs=self.num_decode_seqs)

    def leading(self, num_seqs: int) -> AttentionMetadata:
        """The batch's first `num_seqs` sequences, each feeding one token (views: they are
        the leading rows of every tensor). Queries and outputs keep the whole batch's rows."""
        if not 0 < num_seqs <= self.num_decode_seqs:
            raise ValueError(f"the batch leads with {self.num_decode_seqs} single-token sequences, not {num_seqs}")
        return AttentionMetadata(self.slot_mapping[:num_seqs], self.query_start_loc[: num_seqs + 1],
                                 self.seq_lens[:num_seqs], self.block_tables[:num_seqs], 1, self.max_seq_len,
                                 self.split_counters, num_decode_seqs=num_seqs)

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]

    @property
    def is_decode_only(self) -> bool:
        return self.max_query_len == 1

    @classmethod
    def build(
        cls,
        query_lens: list[int],
        seq_lens: list[int],
        block_tables: list[list[int]],
        block_size: int,
        device: torch.device | str = "cpu",
        max_blocks_per_seq: int | None = None,
        window_tables: list[list[int]] | None = None,
    ) -> "AttentionMetadata":
        """Build metadata from host lists (tests, eager runs; the graph runner fills buffers);
        `window_tables` (paired caches) gives it a `window`."""
        if not (len(query_lens) == len(seq_lens) == len(block_tables)):
            raise ValueError("query_lens, seq_lens and block_tables must have one entry per sequence")
        if window_tables is not None:
            metadata = cls.build(query_lens, seq_lens, block_tables, block_size, device, max_blocks_per_seq)
            window = cls.build(query_lens, seq_lens, window_tables, block_size, device, max_blocks_per_seq)
            metadata.window = metadata.over_tables(window.slot_mapping, window.block_tables)
            return metadata
        slots: list[int] = []
        for query_len, seq_len, table in zip(query_lens, seq_lens, block_tables):
            if query_len > seq_len:
                raise ValueError(f"query_len {query_len} exceeds seq_len {seq_len}")
            if len(table) * block_size < seq_len:
                raise ValueError(f"block table of {len(table)} blocks cannot hold {seq_len} tokens")
            for pos in range(seq_len - query_len, seq_len):
                slots.append(table[pos // block_size] * block_size + pos % block_size)
        width = max_blocks_per_seq or max((len(t) for t in block_tables), default=1) or 1
        padded = [t + [0] * (width - len(t)) for t in block_tables]
        starts = [0]
        for query_len in query_lens:
            starts.append(starts[-1] + query_len)
        return cls(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
            block_tables=torch.tensor(padded, dtype=torch.int32, device=device).reshape(len(block_tables), width),
            max_query_len=max(query_lens, default=0),
            max_seq_len=max(seq_lens, default=0),
            num_decode_seqs=leading_single_tokens(query_lens),
        )


def leading_single_tokens(query_lens: Seq[int]) -> int:
    """How many of a batch's first sequences feed one token each."""
    return next((index for index, query_len in enumerate(query_lens) if query_len != 1), len(query_lens))
