"""One step's model inputs: a `SchedulerOutput` flattened into device tensors.

    SchedulerOutput (entries: token ids, start position, block table, sample, forks)
      -> host int64 array, one pass over the entries (C-level `array.extend`, no per-token
         Python work for decodes; a prefill chunk costs one `extend` per KV block)
      -> one copy to the device (pinned staging buffer + non_blocking on CUDA)
      -> `InputBatch`: views of that one buffer (input ids, positions, attention metadata,
         which hidden rows produce logits, which logits row each sampled sequence draws from)

Sampling rows: an entry with `sample` set produces one logits row (its last token); each
sequence in `entry.sample_seqs` (the entry's own sequence, then its forks) draws one token
from that row, so `sample_rows` maps sampled sequences to logits rows.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence as Seq
from dataclasses import dataclass

import torch

from cleave.engine.scheduler import SchedulerOutput
from cleave.engine.sequence import Sequence
from cleave.kv.metadata import AttentionMetadata


class OutputTokens(Seq[int]):
    """A read-only view of a sequence's generated tokens (no copy of the list per step)."""

    __slots__ = ("_seq",)

    def __init__(self, seq: Sequence) -> None:
        self._seq = seq

    def __len__(self) -> int:
        return self._seq.num_output_tokens

    def __getitem__(self, index):  # type: ignore[no-untyped-def]
        start = self._seq.num_prompt_tokens
        if isinstance(index, slice):
            return self._seq.all_token_ids[start:][index]
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError(index)
        return self._seq.all_token_ids[start + index]

    def __iter__(self):  # type: ignore[no-untyped-def]
        tokens = self._seq.all_token_ids
        return iter(tokens[self._seq.num_prompt_tokens :])


@dataclass
class InputBatch:
    """Device inputs of one forward plus how its logits map to sampled sequences.

    Attributes:
        input_ids: [T] int64 new tokens of every entry, concatenated.
        positions: [T] int64 their positions.
        metadata: attention layout (slot_mapping [T], query_start_loc [E+1], seq_lens [E],
            block_tables [E, W]).
        logits_indices: [R] int64 hidden rows whose logits are needed (one per sampling
            entry), or None when every row is needed (every entry samples one token).
        sample_rows: [S] int64 logits row of each sampled sequence, or None when S == R
            (no forks).
        sampled_seqs: the S sequences that get a token, aligned with `SchedulerOutput.sampled_seqs`.
        num_tokens / num_entries: T and E.
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    metadata: AttentionMetadata
    logits_indices: torch.Tensor | None
    sample_rows: torch.Tensor | None
    sampled_seqs: list[Sequence]
    num_tokens: int
    num_entries: int

    @property
    def is_decode_only(self) -> bool:
        """One new token per entry (a CUDA graph can replay it)."""
        return self.metadata.max_query_len == 1


class InputBatchBuilder:
    """Builds `InputBatch`es on one device, reusing a pinned staging buffer on CUDA.

    Args:
        block_size: tokens per KV block.
        device: where the model runs.
    """

    def __init__(self, block_size: int, device: torch.device) -> None:
        self.block_size = block_size
        self.device = device
        self._pin = device.type == "cuda"
        self._staging: torch.Tensor | None = None

    def build(self, output: SchedulerOutput) -> InputBatch:
        """Flatten `output` (non-empty) into one host buffer and move it in one copy."""
        block_size = self.block_size
        token_ids, positions, slots = array("q"), array("q"), array("q")
        query_starts, seq_lens = array("q", [0]), array("q")
        logits_rows, sample_rows = array("q"), array("q")
        tables: list[Seq[int]] = []
        sampled_seqs: list[Sequence] = []
        has_forks = False
        width = 1
        end_token = 0
        for entry in output.scheduled:
            start, num_new = entry.start_position, entry.num_new_tokens
            end = start + num_new
            table = entry.block_table
            token_ids.extend(entry.token_ids)
            if num_new == 1:
                positions.append(start)
                slots.append(table[start // block_size] * block_size + start % block_size)
            else:
                positions.extend(range(start, end))
                position = start
                while position < end:  # one extend per block the chunk touches
                    block_end = min(end, (position // block_size + 1) * block_size)
                    base = table[position // block_size] * block_size - (position // block_size) * block_size
                    slots.extend(range(base + position, base + block_end))
                    position = block_end
            end_token += num_new
            query_starts.append(end_token)
            seq_lens.append(end)
            tables.append(table)
            width = max(width, len(table))
            if entry.sample:
                row = len(logits_rows)
                logits_rows.append(end_token - 1)
                sample_seqs = entry.sample_seqs
                sampled_seqs.extend(sample_seqs)
                sample_rows.extend([row] * len(sample_seqs))
                has_forks = has_forks or len(sample_seqs) > 1
        block_tables = array("q")
        for table in tables:
            block_tables.extend(table)
            if len(table) < width:
                block_tables.extend([0] * (width - len(table)))

        num_tokens, num_entries = len(token_ids), len(tables)
        needs_logits_index = len(logits_rows) != num_entries or end_token != num_entries
        parts = [token_ids, positions, slots, query_starts, seq_lens, block_tables]
        if needs_logits_index:
            parts.append(logits_rows)
        if has_forks:
            parts.append(sample_rows)
        lengths = [len(part) for part in parts]
        flat = parts[0]  # extended in place: its own length was read above
        for part in parts[1:]:
            flat.extend(part)
        device_buffer = self._to_device(flat)

        views: list[torch.Tensor] = []
        offset = 0
        for length in lengths:
            views.append(device_buffer[offset : offset + length])
            offset += length
        metadata = AttentionMetadata(
            slot_mapping=views[2],
            query_start_loc=views[3].to(torch.int32),
            seq_lens=views[4].to(torch.int32),
            block_tables=views[5].to(torch.int32).view(num_entries, width),
            max_query_len=max(output.query_lens),
            max_seq_len=max(seq_lens),
        )
        index = 6
        logits_indices = sample_rows_tensor = None
        if needs_logits_index:
            logits_indices, index = views[index], index + 1
        if has_forks:
            sample_rows_tensor = views[index]
        return InputBatch(
            input_ids=views[0],
            positions=views[1],
            metadata=metadata,
            logits_indices=logits_indices,
            sample_rows=sample_rows_tensor,
            sampled_seqs=sampled_seqs,
            num_tokens=num_tokens,
            num_entries=num_entries,
        )

    def _to_device(self, flat: array) -> torch.Tensor:
        host = torch.frombuffer(flat, dtype=torch.int64) if len(flat) else torch.empty(0, dtype=torch.int64)
        if not self._pin:
            return host.clone() if self.device.type == "cpu" else host.to(self.device)
        # The previous step's copy has completed: every step ends by reading sampled ids back.
        if self._staging is None or self._staging.numel() < host.numel():
            self._staging = torch.empty(max(host.numel(), 1 << 16), dtype=torch.int64, pin_memory=True)
        staging = self._staging[: host.numel()]
        staging.copy_(host)
        return staging.to(self.device, non_blocking=True)
