"""Output-token counts and prompt-token masks of penalised sequences, kept on the device
from step to step.

Repetition, frequency and presence penalties read, for every row a step samples, how often
each token occurs in its output (and, for the repetition penalty, whether it occurs in its
prompt). Counting them afresh every step costs the host a pass over every penalised row's
whole output and prompt (64 rows of 8192 outputs: 40 ms a step, against a Llama-3.2-1B decode
step of 1.6 ms on an H200; bench/penalty_counts.py, bench/results/penalty_counts/), so a long
reasoning sample with a presence penalty makes every step host-bound. Here each penalised
sequence owns a row of a [rows, V] count table on the
device: a step adds only the tokens its rows gained since they were last counted (one
scatter-add) and gathers the step's rows; a prompt's mask is built once. Rows without
penalties read the zero row 0 (their penalties are neutral, so their counts are never used).

A sequence's row is freed once the sequence object is garbage-collected (the engine drops it
when it ends; the row is zeroed and reused at the next step, on the thread that steps), and
the table grows by doubling when no row is free, up to `max_rows` rows besides the zero row
(`table_bytes`: what the engine's memory budget sets aside for it). At that size a new
sequence takes the row of one the step does not sample (a preempted or waiting one), which
is counted afresh if it comes back. Tokens a sequence has already had counted are assumed
fixed; a sequence whose output got shorter since (a dropped token) is counted again from its
start.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from cleave.device_copy import tensor_on

if TYPE_CHECKING:
    from cleave.engine.sequence import Sequence

__all__ = ["PenaltyCounts"]


@dataclass
class _Row:
    index: int  # the sequence's row of the tables
    counted: int = 0  # its output tokens counted into the row
    has_prompt: bool = False  # its prompt mask filled


class PenaltyCounts:
    """The count and mask tables of one runner's penalised sequences.

    Args:
        vocab_size: V, the logits' width.
        device: where the sampler runs.
        max_rows: most sequences with a row at once (at least a step's rows: max_num_seqs).
    """

    def __init__(self, vocab_size: int, device: torch.device | str, max_rows: int) -> None:
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self.max_rows = max_rows
        self._counts = torch.zeros(2, vocab_size, dtype=torch.int32, device=self.device)  # row 0: zeros
        self._prompt_mask = torch.zeros(2, vocab_size, dtype=torch.bool, device=self.device)
        self._free = [1]
        self._rows: dict[int, _Row] = {}  # id(sequence) -> its row, while the sequence lives
        self._released: list[int] = []  # keys of sequences gone since the last step (any thread appends)

    @property
    def num_rows_held(self) -> int:
        return len(self._rows)

    @staticmethod
    def table_bytes(vocab_size: int, max_rows: int) -> int:
        """Device bytes of the full tables and of one step's gathered rows (max_rows of them)."""
        per_row = vocab_size * (torch.int32.itemsize + torch.bool.itemsize)
        return (2 * max_rows + 1) * per_row

    def gather(self, seqs: Seq[Sequence], with_prompt: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The step's [B, V] int32 output counts and, `with_prompt`, its [B, V] bool prompt
        masks, one row per sequence of `seqs` (zeros for sequences without penalties)."""
        self._free_released()
        step = {id(seq) for seq in seqs}
        indices: list[int] = []
        new_rows: list[int] = []
        new_tokens: list[int] = []
        for seq in seqs:
            if not seq.sampling_params.has_penalties:
                indices.append(0)
                continue
            row = self._row_of(seq, step)
            outputs = seq.num_output_tokens
            if outputs < row.counted:  # tokens were dropped: count the whole output again
                self._counts[row.index].zero_()
                row.counted = 0
            if outputs > row.counted:
                new_tokens += seq.all_token_ids[seq.num_prompt_tokens + row.counted:]
                new_rows += [row.index] * (outputs - row.counted)
                row.counted = outputs
            if with_prompt and not row.has_prompt and seq.sampling_params.has_repetition_penalty:
                prompt = tensor_on(seq.all_token_ids[: seq.num_prompt_tokens], torch.int64, self.device)
                self._prompt_mask[row.index, prompt] = True
                row.has_prompt = True
            indices.append(row.index)
        if new_tokens:
            where = tensor_on(new_rows + new_tokens, torch.int64, self.device).view(2, len(new_tokens))
            ones = torch.ones(len(new_tokens), dtype=torch.int32, device=self.device)
            self._counts.index_put_((where[0], where[1]), ones, accumulate=True)
        index = tensor_on(indices, torch.int64, self.device)
        counts = self._counts.index_select(0, index)
        return counts, self._prompt_mask.index_select(0, index) if with_prompt else None

    def _row_of(self, seq: Sequence, step: set[int]) -> _Row:
        row = self._rows.get(id(seq))
        if row is None:
            if not self._free:
                self._make_room(step)
            row = self._rows[id(seq)] = _Row(self._free.pop())
            weakref.finalize(seq, self._released.append, id(seq))
        return row

    def _make_room(self, step: set[int]) -> None:
        """A free row: the tables doubled, or at `max_rows` the row of a sequence this step
        (`step`: its sequences' ids) does not sample."""
        size = self._counts.shape[0]
        evicted = next((key for key in self._rows if key not in step), None) if size > self.max_rows else None
        if evicted is not None:
            self._free_row(self._rows.pop(evicted))
            return
        grown = max(min(2 * size, self.max_rows + 1), size + 1)  # past max_rows only for a step that big
        self._counts = torch.cat([self._counts, self._counts.new_zeros(grown - size, self.vocab_size)])
        self._prompt_mask = torch.cat([self._prompt_mask, self._prompt_mask.new_zeros(grown - size, self.vocab_size)])
        self._free += range(grown - 1, size - 1, -1)

    def _free_released(self) -> None:
        """Free the rows of the sequences gone since the last step."""
        while self._released:
            row = self._rows.pop(self._released.pop(), None)
            if row is not None:
                self._free_row(row)

    def _free_row(self, row: _Row) -> None:
        self._counts[row.index].zero_()
        self._prompt_mask[row.index] = False
        self._free.append(row.index)
