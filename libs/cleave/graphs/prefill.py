"""CUDA-graph prefill of one short prompt: a captured forward per token-count bucket.

An eager forward launches every kernel from Python, which costs more than the device's
work for a short prompt (a 512-token prefill of a 1B model is host-bound on an H200).
A step that prefills exactly one sequence with at most `max_tokens` new tokens (with or
without a cached prefix) instead replays the graph of the smallest bucket that holds its
tokens. Buckets grow by about half: 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024, ...

Padding: rows past the prompt's tokens are token 0 at position 0 with slot PAD_SLOT_ID, so
they write no KV; the sequence's query length (query_start_loc) is its real token count,
so the attention kernel computes no padded query and no real query sees a padded key.
Every other op works row by row, so the real rows' hidden states are the eager forward's.
The graph returns every row's final hidden state; the caller picks the sampling rows and
computes their logits eagerly (one or a few rows).
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from dataclasses import dataclass

import torch

from cleave.graphs.buckets import NULL_BLOCK_ID, PAD_POSITION, PAD_SLOT_ID, PAD_TOKEN_ID
from cleave.graphs.runner import graph_capture, upload_graphs
from cleave.kv.metadata import AttentionMetadata

ForwardFn = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor]
MIN_BUCKET = 32


def prefill_token_buckets(max_tokens: int) -> list[int]:
    """Ascending token counts to capture: 32, 48, 64, 96, ... (each about 1.5x the one
    before, alternating powers of two and their 1.5x), ending exactly at `max_tokens`."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    buckets: list[int] = []
    power = MIN_BUCKET
    while power < max_tokens:
        buckets.extend(size for size in (power, power * 3 // 2) if size < max_tokens)
        power *= 2
    return buckets + [max_tokens]


@dataclass(frozen=True)
class PrefillGraphConfig:
    """Capacities the prefill graphs are captured for.

    Attributes:
        max_tokens: the largest bucket: prompts (or the uncached part of them) of more new
            tokens run eagerly.
        max_blocks_per_seq: block-table width; context capacity = this * block_size.
        block_size: tokens per KV block.
        window_tables: the batch also carries window tables (a paired cache: cleave.kv.groups).
    """

    max_tokens: int
    max_blocks_per_seq: int
    block_size: int
    window_tables: bool = False

    def __post_init__(self) -> None:
        # The buffers' metadata claims the whole context (max_seq_len = the capacity), so a
        # bucket that filled it would pass for a lone fresh prompt in the eager warm-up before
        # each capture; dense attention would then gather the padding's slots (a device-side
        # assert on CUDA, which leaves the context unusable) where the graph runs the paged kernel.
        capacity = self.max_blocks_per_seq * self.block_size
        if not 1 <= self.max_tokens < capacity:
            raise ValueError(f"max_tokens must be in [1, {capacity}) (the context capacity: "
                             f"{self.max_blocks_per_seq} blocks of {self.block_size}), got {self.max_tokens}")


class StaticPrefillBuffers:
    """The inputs every prefill graph reads: `max_tokens` rows of one sequence."""

    def __init__(self, config: PrefillGraphConfig, device: torch.device | str) -> None:
        self.config = config
        self.input_ids = torch.full((config.max_tokens,), PAD_TOKEN_ID, dtype=torch.int64, device=device)
        self.positions = torch.full((config.max_tokens,), PAD_POSITION, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((config.max_tokens,), PAD_SLOT_ID, dtype=torch.int64, device=device)
        self.query_start_loc = torch.zeros(2, dtype=torch.int32, device=device)
        self.seq_lens = torch.zeros(1, dtype=torch.int32, device=device)
        self.block_tables = torch.full((1, config.max_blocks_per_seq), NULL_BLOCK_ID, dtype=torch.int32,
                                       device=device)
        # the window tables' (slots, table) of a paired cache, else None
        self.window: tuple[torch.Tensor, torch.Tensor] | None = None
        if config.window_tables:
            self.window = (torch.full_like(self.slot_mapping, PAD_SLOT_ID),
                           torch.full_like(self.block_tables, NULL_BLOCK_ID))
        self._filled_tokens = 0  # rows [0, _filled_tokens) hold the last prompt's tokens
        self._filled_width = 0  # block-table columns the last prompt wrote

    def metadata(self, bucket: int) -> AttentionMetadata:
        """Views of the first `bucket` rows, as the graph for `bucket` reads them."""
        metadata = AttentionMetadata(
            slot_mapping=self.slot_mapping[:bucket],
            query_start_loc=self.query_start_loc,
            seq_lens=self.seq_lens,
            block_tables=self.block_tables,
            max_query_len=bucket,
            max_seq_len=self.config.max_blocks_per_seq * self.config.block_size,
        )
        if self.window is not None:
            window_slots, window_tables = self.window
            metadata.window = metadata.over_tables(window_slots[:bucket], window_tables)
        return metadata

    def fill(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata) -> None:
        """Copy one sequence's new tokens into rows [0, n) and its layout into the
        metadata buffers; rows and block-table columns the previous fill used past these
        become padding again."""
        num_tokens, width = input_ids.shape[0], metadata.block_tables.shape[1]
        self.input_ids[:num_tokens].copy_(input_ids, non_blocking=True)
        self.positions[:num_tokens].copy_(positions, non_blocking=True)
        if self._filled_tokens > num_tokens:
            self.input_ids[num_tokens:self._filled_tokens].fill_(PAD_TOKEN_ID)
            self.positions[num_tokens:self._filled_tokens].fill_(PAD_POSITION)
        self.query_start_loc.copy_(metadata.query_start_loc, non_blocking=True)
        self.seq_lens.copy_(metadata.seq_lens, non_blocking=True)
        self._fill_tables(self.slot_mapping, self.block_tables, metadata, num_tokens, width)
        if self.window is not None:
            if metadata.window is None:
                raise ValueError("the prefill graphs were captured with window tables; the batch has none")
            self._fill_tables(*self.window, metadata.window, num_tokens, width)
        self._filled_tokens, self._filled_width = num_tokens, width

    def _fill_tables(self, slot_mapping: torch.Tensor, block_tables: torch.Tensor, metadata: AttentionMetadata,
                     num_tokens: int, width: int) -> None:
        """One table group's slots and block table, padding past them what the last fill used."""
        slot_mapping[:num_tokens].copy_(metadata.slot_mapping, non_blocking=True)
        if self._filled_tokens > num_tokens:
            slot_mapping[num_tokens:self._filled_tokens].fill_(PAD_SLOT_ID)
        block_tables[:, :width].copy_(metadata.block_tables, non_blocking=True)
        if self._filled_width > width:
            block_tables[:, width:self._filled_width].fill_(NULL_BLOCK_ID)

    def reset(self) -> None:
        """Every row padding and a sequence of no tokens (capture warm-ups touch no KV)."""
        self.input_ids.fill_(PAD_TOKEN_ID)
        self.positions.fill_(PAD_POSITION)
        self.slot_mapping.fill_(PAD_SLOT_ID)
        self.query_start_loc.zero_()
        self.seq_lens.zero_()
        self.block_tables.fill_(NULL_BLOCK_ID)
        if self.window is not None:
            self.window[0].fill_(PAD_SLOT_ID)
            self.window[1].fill_(NULL_BLOCK_ID)
        self._filled_tokens = self._filled_width = 0


class PrefillGraphRunner:
    """Replays a captured prefill forward (`forward_fn(input_ids, positions, metadata) ->
    hidden [T, H]`, free of host syncs) for one sequence's new tokens.

    `capture()` is a no-op off CUDA; there `run` pads a prompt into its bucket and runs
    the padded forward eagerly, the same computation the graph replays (what CPU tests
    check the padding with).
    """

    def __init__(self, forward_fn: ForwardFn, config: PrefillGraphConfig, device: torch.device | str) -> None:
        self.forward_fn = forward_fn
        self.config = config
        self.device = torch.device(device)
        self.buckets = prefill_token_buckets(config.max_tokens)
        self.buffers = StaticPrefillBuffers(config, self.device)
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._outputs: dict[int, torch.Tensor] = {}

    @property
    def is_captured(self) -> bool:
        return bool(self._graphs)

    @torch.inference_mode()
    def capture(self) -> None:
        """One graph per bucket, largest first, in one memory pool (smaller graphs reuse the
        larger ones' memory)."""
        if self.device.type != "cuda" or self.is_captured:
            return
        self.buffers.reset()
        torch.cuda.synchronize(self.device)
        pool: tuple[int, int] | None = None
        for bucket in sorted(self.buckets, reverse=True):
            input_ids, positions = self.buffers.input_ids[:bucket], self.buffers.positions[:bucket]
            metadata = self.buffers.metadata(bucket)
            self.forward_fn(input_ids, positions, metadata)  # warm-up: kernels compiled, workspaces set
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with graph_capture(graph, pool=pool):
                self._outputs[bucket] = self.forward_fn(input_ids, positions, metadata)
            pool = pool or graph.pool()
            self._graphs[bucket] = graph
        upload_graphs(self._graphs.values())
        torch.cuda.synchronize(self.device)

    def bucket_for(self, input_ids: torch.Tensor, metadata: AttentionMetadata) -> int | None:
        """The bucket that runs this batch, or None when it is not one sequence's prefill
        within the capacities (it then runs eagerly)."""
        num_tokens = input_ids.shape[0]
        if (
            metadata.num_seqs != 1
            or num_tokens < 2
            or num_tokens > self.config.max_tokens
            or metadata.max_query_len != num_tokens
            or metadata.block_tables.shape[1] > self.config.max_blocks_per_seq
        ):
            return None
        return self.buckets[bisect.bisect_left(self.buckets, num_tokens)]

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata,
            bucket: int) -> torch.Tensor:
        """Hidden states [n, H] of the prompt's n new tokens (`bucket` from `bucket_for`)."""
        num_tokens = input_ids.shape[0]
        self.buffers.fill(input_ids, positions, metadata)
        graph = self._graphs.get(bucket)
        if graph is None:  # off CUDA, or not captured: the padded forward, eagerly
            hidden = self.forward_fn(self.buffers.input_ids[:bucket], self.buffers.positions[:bucket],
                                     self.buffers.metadata(bucket))
            return hidden[:num_tokens]
        graph.replay()
        return self._outputs[bucket][:num_tokens]
