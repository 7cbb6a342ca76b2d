"""One step's model inputs: a `SchedulerOutput` flattened into device tensors.

    SchedulerOutput (entries: token ids, start position, block table, sample, forks)
      -> host int64 array, one pass over the entries (C-level `array.extend`, no per-token
         Python work for decodes; a prefill chunk costs one `extend` per KV block)
      -> one copy to the device (pinned staging buffer + non_blocking on CUDA)
      -> `InputBatch`: views of that one buffer (input ids, positions, attention metadata,
         which hidden rows produce logits, which logits row each sampled sequence draws from)

A pure decode step (one token per entry, every entry samples, no forks) takes a shorter
path: one int64 host buffer holds input ids, positions, slots and the int32 seq lens (two
per int64 word, reinterpreted on the device without a kernel), and the block tables stay
in a persistent [E, W] int32 tensor that is rewritten only when the batch's membership
changes, a table grows past the width or changes its last block, or the KV manager replaces
a table (blocks dropped behind a sliding window); otherwise a decode only writes into a
block it already has. Entries with window tables (a paired cache, `cleave.kv.groups`) give
the batch a second set of slots and tables, `metadata.window`, built the same way.

Sampling rows: an entry with `sample` set produces one logits row (its last token); each
sequence in `entry.sample_seqs` (the entry's own sequence, then its forks) draws one token
from that row, so `sample_rows` maps sampled sequences to logits rows.

Stand-ins: a decode entry of an overlapped step may feed `stand_in_token(row)`, a token the
previous launched step is still sampling. The batch says where they are
(`stand_in_rows` / `stand_in_sources`, or `all_stand_ins`) and the model runner copies the
sampled ids into `input_ids` on the device.

Host buffers are reused only after the device has read them: on CUDA two staging buffers
alternate, each guarded by an event recorded after its copy (with overlapped steps the host
prepares step N+1 while step N's copy may still be queued).
"""

from __future__ import annotations

import operator
from array import array
from itertools import compress
from collections.abc import Sequence as Seq
from dataclasses import dataclass

import torch

from cleave.engine.scheduler import SchedulerOutput
from cleave.engine.scheduler_output import stand_in_row
from cleave.engine.sequence import Sequence
from cleave.kv.metadata import MAX_KV_HEADS, AttentionMetadata, leading_single_tokens, zeroed_split_counters

_LAST = operator.itemgetter(-1)


class OutputTokens(Seq[int]):
    """A read-only view of a sequence's generated tokens (no copy of the list per step)."""

    __slots__ = ("_seq",)

    def __init__(self, seq: Sequence) -> None:
        self._seq = seq

    def __len__(self) -> int:
        return self._seq.num_output_tokens

    def __getitem__(self, index):  # type: ignore[no-untyped-def]
        start = self._seq.num_prompt_tokens
        if isinstance(index, slice):  # the slice's tokens only (a processor's new tokens), not a copy of all
            first, stop, step = index.indices(len(self))
            if step < 0:
                return self._seq.all_token_ids[start:][index]
            return self._seq.all_token_ids[start + first : start + max(first, stop) : step]
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
        stand_in_rows: [K] int64 rows of `input_ids` holding stand-ins, None when there are
            none or `all_stand_ins`.
        stand_in_sources: [K] int64 the previous step's sampled row each one takes.
        all_stand_ins: every input token is the stand-in of the same row of the previous
            step (a steady decode batch): `input_ids` is that step's first T tokens.
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    metadata: AttentionMetadata
    logits_indices: torch.Tensor | None
    sample_rows: torch.Tensor | None
    sampled_seqs: list[Sequence]
    num_tokens: int
    num_entries: int
    stand_in_rows: torch.Tensor | None = None
    stand_in_sources: torch.Tensor | None = None
    all_stand_ins: bool = False

    @property
    def has_stand_ins(self) -> bool:
        return self.all_stand_ins or self.stand_in_rows is not None

    @property
    def is_decode_only(self) -> bool:
        """One new token per entry (a CUDA graph can replay it)."""
        return self.metadata.max_query_len == 1


@dataclass
class _DecodeTables:
    """Block tables of the previous pure-decode batch, kept for the next one.

    Attributes:
        seqs: the batch's sequences in row order.
        lengths / lasts: each row's table length and last block id when it was written.
        tables: each row's table object then (the manager replaces a table it drops blocks from).
        host: [E, W] int32 (pinned on CUDA); device: the same on the model's device.
        copied: on CUDA, an event recorded after the latest host -> device copy.
    """

    seqs: list[Sequence]
    lengths: list[int]
    lasts: list[int]
    tables: list[Seq[int]]
    host: torch.Tensor
    device: torch.Tensor
    copied: torch.cuda.Event | None = None


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
        # Two pinned staging buffers, alternating, each with the event of its latest copy.
        self._staging: list[torch.Tensor | None] = [None, None]
        self._staged: list[torch.cuda.Event | None] = [None, None]
        self._next_staging = 0
        self._all_stand_ins: dict[int, array] = {}  # E -> stand_in_token(0..E-1)
        # per table group (block tables, window tables): the previous decode batch's tables
        self._decode_tables: list[_DecodeTables | None] = [None, None]
        self._query_starts: dict[int, torch.Tensor] = {}  # E -> arange(E + 1) int32 on device
        # zeroed scratch the split kernels count in, shared by every batch (each launch leaves
        # it zeroed; one stream runs them in order), so no attention layer zeroes its own
        self._split_counters: torch.Tensor | None = None

    def _counters(self, num_entries: int) -> torch.Tensor:
        """The shared split counters, grown (zeroed anew) for a batch of more entries than
        they were sized for."""
        counters = self._split_counters
        if counters is None or counters.numel() < num_entries * MAX_KV_HEADS:
            counters = self._split_counters = zeroed_split_counters(num_entries, self.device)
        return counters

    def build(self, output: SchedulerOutput) -> InputBatch:
        """Flatten `output` (non-empty) into one host buffer and move it in one copy."""
        batch = self._build_decode(output)
        if batch is not None:
            return batch
        self._decode_tables = [None, None]
        return self.build_general(output)

    def build_general(self, output: SchedulerOutput) -> InputBatch:
        """The path for any step (prefill chunks, forks); `build` uses it unless the step is a pure decode."""
        block_size = self.block_size
        token_ids, positions, slots = array("q"), array("q"), array("q")
        query_starts, seq_lens = array("q", [0]), array("q")
        logits_rows, sample_rows = array("q"), array("q")
        tables: list[Seq[int]] = []
        sampled_seqs: list[Sequence] = []
        has_forks = False
        width = 1
        end_token = 0
        stand_in_rows, stand_in_sources = array("q"), array("q")
        has_windows = output.scheduled[0].window_table is not None
        window_slots, window_tables = array("q"), []
        for entry in output.scheduled:
            start, num_new = entry.start_position, entry.num_new_tokens
            end = start + num_new
            table = entry.block_table
            token_ids.extend(entry.token_ids)
            if num_new == 1:
                if entry.token_ids[0] < 0:
                    stand_in_rows.append(end_token)
                    stand_in_sources.append(stand_in_row(entry.token_ids[0]))
                positions.append(start)
                slots.append(table[start // block_size] * block_size + start % block_size)
            else:
                positions.extend(range(start, end))
                _extend_slots(slots, table, start, end, block_size)
            if has_windows:
                window_tables.append(entry.window_table)
                _extend_slots(window_slots, entry.window_table, start, end, block_size)
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
        block_tables = _padded_tables(tables, width)

        num_tokens, num_entries = len(token_ids), len(tables)
        needs_logits_index = len(logits_rows) != num_entries or end_token != num_entries
        parts = [token_ids, positions, slots, query_starts, seq_lens, block_tables]
        if has_windows:
            parts.extend((window_slots, _padded_tables(window_tables, width)))
        if needs_logits_index:
            parts.append(logits_rows)
        if has_forks:
            parts.append(sample_rows)
        if stand_in_rows:
            parts.extend((stand_in_rows, stand_in_sources))
        lengths = [len(part) for part in parts]
        flat = parts[0]  # extended in place: its own length was read above
        for part in parts[1:]:
            if len(flat) % 2:
                flat.append(0)  # every part starts 16-byte aligned (see `_build_decode`)
            flat.extend(part)
        device_buffer = self._to_device(flat)

        views: list[torch.Tensor] = []
        offset = 0
        for length in lengths:
            views.append(device_buffer[offset : offset + length])
            offset += length + length % 2
        query_lens = output.query_lens
        metadata = AttentionMetadata(
            slot_mapping=views[2],
            query_start_loc=views[3].to(torch.int32),
            seq_lens=views[4].to(torch.int32),
            block_tables=views[5].to(torch.int32).view(num_entries, width),
            max_query_len=max(query_lens),
            max_seq_len=max(seq_lens),
            split_counters=self._counters(num_entries),
            num_decode_seqs=leading_single_tokens(query_lens),
        )
        index = 6
        if has_windows:
            metadata.window = metadata.over_tables(views[6], views[7].to(torch.int32).view(num_entries, width))
            index = 8
        logits_indices = sample_rows_tensor = None
        if needs_logits_index:
            logits_indices, index = views[index], index + 1
        if has_forks:
            sample_rows_tensor, index = views[index], index + 1
        return InputBatch(
            input_ids=views[0],
            positions=views[1],
            metadata=metadata,
            logits_indices=logits_indices,
            sample_rows=sample_rows_tensor,
            sampled_seqs=sampled_seqs,
            num_tokens=num_tokens,
            num_entries=num_entries,
            stand_in_rows=views[index] if stand_in_rows else None,
            stand_in_sources=views[index + 1] if stand_in_rows else None,
        )

    def _build_decode(self, output: SchedulerOutput) -> InputBatch | None:
        """The pure-decode fast path, or None when `output` is anything else."""
        if output.has_forks:
            return None
        scheduled = output.scheduled
        for entry in scheduled:
            if entry.num_new_tokens != 1 or not entry.sample:
                return None
        block_size = self.block_size
        # One comprehension per column: cheaper than appending to four arrays per entry.
        tables: list[Seq[int]] = [entry.block_table for entry in scheduled]
        starts = [entry.start_position for entry in scheduled]
        flat = array("q", [entry.token_ids[0] for entry in scheduled])  # [E] ids, then the rest below
        positions = array("q", starts)
        slots = array("q", [table[start // block_size] * block_size + start % block_size
                            for table, start in zip(tables, starts)])
        seq_lens = array("i", [start + 1 for start in starts])
        num_entries = len(tables)
        stand_ins = self._stand_ins(flat)
        # Each column starts 16-byte aligned (`span` int64s apart): a kernel handed a view at
        # an odd int64 offset specialises on the misaligned pointer (a compile in the middle
        # of a run) and takes triton's slow launch path (`CachedLauncher`) on every such step.
        span = num_entries + num_entries % 2
        pad = [0] * (span - num_entries)
        flat.extend(pad)
        flat.extend(positions)
        flat.extend(pad)
        flat.extend(slots)
        flat.extend(pad)
        window_tables = None
        if scheduled[0].window_table is not None:
            window_tables = [entry.window_table for entry in scheduled]
            flat.extend([table[start // block_size] * block_size + start % block_size
                         for table, start in zip(window_tables, starts)])
            flat.extend(pad)
        seq_lens_start = len(flat)
        seq_lens.extend([0] * (-num_entries % 4))  # int32s: a whole number of 16-byte words
        flat.frombytes(seq_lens.tobytes())
        seq_lens_end = len(flat)
        if stand_ins:
            flat.extend(stand_ins[0])
            if len(stand_ins[0]) % 2:
                flat.append(0)
            flat.extend(stand_ins[1])
        device_buffer = self._to_device(flat)
        seqs = [entry.seq for entry in scheduled]
        metadata = AttentionMetadata(
            slot_mapping=device_buffer[2 * span : 2 * span + num_entries],
            query_start_loc=self._query_start_loc(num_entries),
            seq_lens=device_buffer[seq_lens_start:seq_lens_end].view(torch.int32)[:num_entries],
            block_tables=self._block_tables(seqs, tables),
            max_query_len=1,
            max_seq_len=max(seq_lens),
            split_counters=self._counters(num_entries),
            num_decode_seqs=num_entries,
        )
        if window_tables is not None:
            metadata.window = metadata.over_tables(device_buffer[3 * span : 3 * span + num_entries],
                                                   self._block_tables(seqs, window_tables, group=1))
        return InputBatch(
            input_ids=device_buffer[:num_entries],
            positions=device_buffer[span : span + num_entries],
            metadata=metadata,
            logits_indices=None,
            sample_rows=None,
            sampled_seqs=seqs,
            num_tokens=num_entries,
            num_entries=num_entries,
            stand_in_rows=device_buffer[seq_lens_end : seq_lens_end + len(stand_ins[0])] if stand_ins else None,
            stand_in_sources=(device_buffer[seq_lens_end + len(stand_ins[0]) + len(stand_ins[0]) % 2 :]
                              if stand_ins else None),
            all_stand_ins=stand_ins == (),
        )

    def _stand_ins(self, token_ids: array) -> tuple[array, array] | tuple[()] | None:
        """Stand-ins among a decode batch's input ids: None (none), () (row i feeds the
        stand-in of row i, for every row) or (rows, source rows)."""
        if not token_ids or min(token_ids) >= 0:
            return None
        count = len(token_ids)
        steady = self._all_stand_ins.get(count)
        if steady is None:
            steady = self._all_stand_ins[count] = array("q", range(-1, -1 - count, -1))
        if token_ids == steady:
            return ()
        rows, sources = array("q"), array("q")
        for row, token in enumerate(token_ids):
            if token < 0:
                rows.append(row)
                sources.append(stand_in_row(token))
        return rows, sources

    def _query_start_loc(self, num_entries: int) -> torch.Tensor:
        starts = self._query_starts.get(num_entries)
        if starts is None:
            starts = torch.arange(num_entries + 1, dtype=torch.int32, device=self.device)
            self._query_starts[num_entries] = starts
        return starts

    def _block_tables(self, seqs: list[Sequence], tables: list[Seq[int]], group: int = 0) -> torch.Tensor:
        """[E, W] int32 device tables of a decode batch (`group` 1: its window tables),
        reusing the previous step's."""
        lengths = list(map(len, tables))
        lasts = list(map(_LAST, tables))
        kept = self._decode_tables[group]
        if kept is not None and len(kept.seqs) == len(seqs) and all(map(operator.is_, kept.seqs, seqs)):
            same_tables = all(map(operator.is_, kept.tables, tables))
            if same_tables and lengths == kept.lengths and lasts == kept.lasts:
                return kept.device
            width = max(lengths)
            if width > kept.host.shape[1]:
                self._widen(kept, width)
            slots, block_ids = self._changed_entries(kept.host.shape[1], kept.tables, kept.lengths, kept.lasts,
                                                     tables, lengths, lasts)
            if slots:
                if kept.copied is not None:
                    kept.copied.synchronize()  # the device has read the host tensor
                # one scatter for every changed entry of the batch
                kept.host.view(-1)[torch.frombuffer(slots, dtype=torch.int64)] = torch.frombuffer(
                    block_ids, dtype=torch.int32
                )
            kept.lengths, kept.lasts, kept.tables = lengths, lasts, tables
            if kept.device is not kept.host:
                kept.device.copy_(kept.host, non_blocking=True)
                kept.copied = self._record_copy(kept.copied)
            return kept.device
        width = max(lengths)
        if kept is not None:
            regathered = self._regathered(kept, seqs, tables, lengths, lasts, width)
            if regathered is not None:
                self._decode_tables[group] = regathered
                return regathered.device
        flat = array("i")
        for table, length in zip(tables, lengths):
            flat.extend(table)
            if length < width:
                flat.frombytes(bytes(4 * (width - length)))  # zero padding: the null block
        host = torch.frombuffer(flat, dtype=torch.int32).view(len(tables), width).clone()
        if self._pin:
            host = host.pin_memory()
        kept = self._decode_tables[group] = self._uploaded(seqs, lengths, lasts, tables, host)
        return kept.device

    def _regathered(
        self, kept: _DecodeTables, seqs: list[Sequence], tables: list[Seq[int]], lengths: list[int],
        lasts: list[int], width: int,
    ) -> _DecodeTables | None:
        """The tables of a batch whose membership changed (sequences finished, joined or
        moved), built from the kept ones: the rows of sequences still in the batch gathered
        in one copy, then only the entries that differ written (a joining sequence's whole
        row). None when fewer than half the rows carry over (a fresh build is as cheap).

        Writing every row of a changed batch from its Python list is ~2.7 us a row (0.7 ms at
        256 rows of ~96 blocks); a serving decode batch changes membership on most steps.
        """
        old_row = {id(seq): row for row, seq in enumerate(kept.seqs)}
        rows = [old_row.get(id(seq), -1) for seq in seqs]
        joined = rows.count(-1)
        if 2 * joined > len(rows):
            return None
        old_width = kept.host.shape[1]
        columns = min(width, old_width)
        gathered = kept.host[:, :columns].index_select(0, torch.tensor([max(row, 0) for row in rows]))
        host = torch.empty((len(rows), width), dtype=torch.int32, pin_memory=self._pin)
        host[:, :columns] = gathered
        if width > columns:
            host[:, columns:] = 0  # the null block
        # each row's previous table, length and last block (a joining row, -1: the appended none)
        old_tables = list(map([*kept.tables, None].__getitem__, rows))
        old_lengths = list(map([*kept.lengths, 0].__getitem__, rows))
        old_lasts = list(map([*kept.lasts, -1].__getitem__, rows))
        slots, block_ids = self._changed_entries(width, old_tables, old_lengths, old_lasts, tables, lengths, lasts)
        if slots:
            host.view(-1)[torch.frombuffer(slots, dtype=torch.int64)] = torch.frombuffer(block_ids, dtype=torch.int32)
        return self._uploaded(seqs, lengths, lasts, tables, host)

    def _uploaded(self, seqs: list[Sequence], lengths: list[int], lasts: list[int], tables: list[Seq[int]],
                  host: torch.Tensor) -> _DecodeTables:
        """New kept tables: `host` (pinned on CUDA) and its copy on the device, queued."""
        copied = None
        if self._pin:
            device = host.to(self.device, non_blocking=True)
            copied = self._record_copy(None)
        else:
            device = host if self.device.type == "cpu" else host.to(self.device)
        return _DecodeTables(list(seqs), lengths, lasts, tables, host, device, copied)

    def _widen(self, kept: _DecodeTables, width: int) -> None:
        """Give the kept tables `width` columns: the old ones, then zeros (the null block)."""
        host = torch.zeros(kept.host.shape[0], width, dtype=torch.int32, pin_memory=self._pin)
        host[:, : kept.host.shape[1]] = kept.host
        kept.host, kept.copied = host, None  # a new host tensor: no copy of it to wait for
        kept.device = host if self.device.type == "cpu" else torch.empty_like(host, device=self.device)

    @staticmethod
    def _changed_entries(
        width: int, old_tables: list, old_lengths: list[int], old_lasts: list[int],
        tables: list[Seq[int]], lengths: list[int], lasts: list[int],
    ) -> tuple[array, array]:
        """(flat [E * width] positions, block ids) of the table entries that differ from each
        row's previous table (`old_*`, row for row).

        The KV manager changes a table in place only at its end (new blocks appended, the
        last block copied on write) and replaces it otherwise, so a table that is still the
        same object needs only its entries from its previous last one on; another object (or
        a row new to the batch: old table None) is written whole, its padding included.
        """
        # Rows whose length, last block or table object changed, found without a Python loop
        # over the batch (most decode steps change a few rows, or none).
        changed = map(operator.or_, map(operator.ne, lengths, old_lengths), map(operator.ne, lasts, old_lasts))
        changed = map(operator.or_, changed, map(operator.is_not, tables, old_tables))
        slots, block_ids = array("q"), array("i")
        for row in compress(range(len(tables)), changed):
            table, length = tables[row], lengths[row]
            base = row * width
            if table is old_tables[row]:
                start = max(old_lengths[row] - 1, 0)
                slots.extend(range(base + start, base + length))
                block_ids.extend(table[start:length])
            else:
                slots.extend(range(base, base + width))
                block_ids.extend(table)
                block_ids.frombytes(bytes(4 * (width - length)))  # the null block
        return slots, block_ids

    @staticmethod
    def _record_copy(event: torch.cuda.Event | None) -> torch.cuda.Event:
        """Mark the copies queued so far (reusing `event` when there is one)."""
        event = torch.cuda.Event() if event is None else event
        event.record()
        return event

    def _to_device(self, flat: array) -> torch.Tensor:
        host = torch.frombuffer(flat, dtype=torch.int64) if len(flat) else torch.empty(0, dtype=torch.int64)
        if not self._pin:
            return host.clone() if self.device.type == "cpu" else host.to(self.device)
        index = self._next_staging
        self._next_staging = 1 - index
        staged = self._staged[index]
        if staged is not None:
            staged.synchronize()  # its copy two steps ago has run
        buffer = self._staging[index]
        if buffer is None or buffer.numel() < host.numel():
            buffer = self._staging[index] = torch.empty(max(host.numel(), 1 << 16), dtype=torch.int64, pin_memory=True)
        staging = buffer[: host.numel()]
        staging.copy_(host)
        device = staging.to(self.device, non_blocking=True)
        self._staged[index] = self._record_copy(staged)
        return device


def _extend_slots(slots: array, table: Seq[int], start: int, end: int, block_size: int) -> None:
    """Append the slots of positions start..end-1 through `table` (one extend per block)."""
    position = start
    while position < end:
        block_end = min(end, (position // block_size + 1) * block_size)
        base = table[position // block_size] * block_size - (position // block_size) * block_size
        slots.extend(range(base + position, base + block_end))
        position = block_end


def _padded_tables(tables: list[Seq[int]], width: int) -> array:
    """The tables row after row, each padded with the null block to `width`."""
    flat = array("q")
    for table in tables:
        flat.extend(table)
        if len(table) < width:
            flat.extend([0] * (width - len(table)))
    return flat
