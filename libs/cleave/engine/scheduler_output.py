"""The typed plan of one scheduler step: `ScheduledSequence` entries in a `SchedulerOutput`,
and the scheduler's cumulative `SchedulerStats`. Plain data, CPU only; the scheduler builds
it, the model runner and input batch read it (see `cleave.engine.scheduler`)."""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from functools import cached_property

from cleave.engine.sequence import Sequence


def stand_in_token(row: int) -> int:
    """The token id a sequence carries for a token still being sampled into `row` of the
    launched step's `sampled_seqs` (negative, so never a real id; see `Scheduler.advance`)."""
    return -1 - row


def stand_in_row(token_id: int) -> int:
    """Inverse of `stand_in_token`: the launched step's sampled row a stand-in refers to."""
    return -1 - token_id


@dataclass(slots=True)
class ScheduledSequence:
    """One sequence's share of a step (read-only for everyone but the scheduler).

    Not frozen: a frozen dataclass costs ~1 us per construction, once per sequence per step.

    Attributes:
        seq: the sequence (read its sampling_params; do not mutate).
        num_new_tokens: tokens fed this step (a prefill chunk, or 1 for a decode).
        token_ids: [num_new_tokens] token ids to feed.
        start_position: position of token_ids[0]; the context is start_position tokens long
            before this step and seq_len after it.
        sample: whether to compute logits of the last fed token and sample (prefill complete).
        block_table: the sequence's block ids; a live read-only view valid until the next
            schedule() call.
        forks: samples of the same request that draw their first token from this entry's
            logits and share its blocks from the next step on.
        is_prefill: False only for a decode step (feeding the last sampled token).
        window_table: the sequence's window table (a paired cache: cleave.kv.groups), a live
            view as `block_table`; None without one.
    """

    seq: Sequence
    num_new_tokens: int
    token_ids: list[int]
    start_position: int
    sample: bool
    block_table: Seq[int]
    forks: tuple[Sequence, ...] = ()
    is_prefill: bool = True
    window_table: Seq[int] | None = None

    @property
    def seq_id(self) -> str:
        return self.seq.seq_id

    @property
    def seq_len(self) -> int:
        """Context length including this step's tokens."""
        return self.start_position + self.num_new_tokens

    @property
    def sample_seqs(self) -> tuple[Sequence, ...]:
        """Sequences that get a token sampled from this entry's logits, in order."""
        return (self.seq, *self.forks) if self.sample else ()


@dataclass(frozen=True)
class SchedulerOutput:
    """What one step runs.

    Attributes:
        scheduled: entries in batch order (decodes first, then prefill chunks).
        block_copies: (src, dst) KV block copies to apply before this step's forward.
        preempted_seq_ids: sequences whose KV was dropped in this step's scheduling.
        finished_seq_ids: sequences that finished or were aborted since the previous output.
    """

    scheduled: list[ScheduledSequence]
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    preempted_seq_ids: list[str] = field(default_factory=list)
    finished_seq_ids: list[str] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled

    @property
    def num_batched_tokens(self) -> int:
        return sum(entry.num_new_tokens for entry in self.scheduled)

    @cached_property
    def sampled_seqs(self) -> list[Sequence]:
        """Sequences that receive a token this step; `resolve`'s tokens align with this."""
        if self.has_forks:
            return [seq for entry in self.scheduled for seq in entry.sample_seqs]
        return [entry.seq for entry in self.scheduled if entry.sample]

    @cached_property
    def has_forks(self) -> bool:
        """Whether any entry hands its logits to forks (sampled_seqs longer than the sampling entries)."""
        for entry in self.scheduled:
            if entry.forks and entry.sample:
                return True
        return False

    @property
    def query_lens(self) -> list[int]:
        return [entry.num_new_tokens for entry in self.scheduled]

    @property
    def seq_lens(self) -> list[int]:
        return [entry.seq_len for entry in self.scheduled]

    @property
    def block_tables(self) -> list[list[int]]:
        """Copies of the block tables, e.g. for `AttentionMetadata.build`."""
        return [list(entry.block_table) for entry in self.scheduled]


@dataclass
class SchedulerStats:
    """Cumulative counters since the scheduler started."""

    num_steps: int = 0
    num_prefill_tokens: int = 0  # prompt (and recomputed) tokens run through the model
    num_decode_tokens: int = 0
    num_prefix_cache_hit_tokens: int = 0
    num_prefix_cache_query_tokens: int = 0  # tokens of admitted sequences looked up in the prefix cache
    num_preemptions: int = 0
