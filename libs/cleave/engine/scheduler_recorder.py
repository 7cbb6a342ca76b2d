"""The scheduler's step recorder: what a run step changes in its sequences.

`StepRecorder` owns the launched-but-unrecorded `SchedulerOutput` and records it in one of
two ways (the protocol is in `cleave.engine.scheduler`):

- `postprocess`: tokens known. Computed tokens advance, sampled tokens are appended, newly
  full blocks go into the prefix cache, pending forks take shared references to their
  leader's blocks, and sequences that should stop are finished.
- `advance` then `resolve`: overlapped steps. `advance` counts the tokens as computed and
  appends a stand-in (`stand_in_token(row)`) per sampled sequence so the next step can be
  planned at once; `resolve` later writes the real ids over the stand-ins, indexes blocks
  and runs the stop checks.

Finishing a sequence (queues and blocks) is the scheduler's `finish` callback.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from collections.abc import Sequence as Seq

from cleave.engine.scheduler_blocks import SchedulerBlocks
from cleave.engine.scheduler_output import SchedulerOutput, stand_in_token
from cleave.engine.scheduler_queues import SequenceQueues
from cleave.engine.sequence import FINISHED_STATUSES, RUNNING, Sequence, SequenceStatus

StopChecker = Callable[[Sequence], "SequenceStatus | None"]
"""Returns a FINISHED_* status when a sequence that just got a token should stop, else None."""

TokenChecker = Callable[[Sequence, int], "SequenceStatus | None"]
"""`StopChecker` of `resolve`: also gets the token (the sequence may hold later stand-ins)."""

FinishFn = Callable[[Sequence, SequenceStatus], None]
"""Ends a sequence with a FINISHED_* status, promoting its pending forks."""


class StepRecorder:
    """Records launched steps: sampled tokens, computed tokens, forks, prefix indexing, stops."""

    def __init__(self, max_model_len: int, queues: SequenceQueues, blocks: SchedulerBlocks, finish: FinishFn) -> None:
        self.max_model_len = max_model_len
        self._queues = queues
        self._blocks = blocks
        self._finish = finish
        self._in_flight: SchedulerOutput | None = None

    @property
    def in_flight(self) -> SchedulerOutput | None:
        """The latest planned step that has work and is not recorded yet."""
        return self._in_flight

    def expect(self, output: SchedulerOutput) -> None:
        """Note a freshly planned step: the next `postprocess` or `advance` must record it."""
        self._in_flight = output if output.scheduled else None

    def postprocess(
        self, output: SchedulerOutput, sampled_token_ids: Mapping[str, int] | Seq[int], stop_checker: StopChecker | None
    ) -> list[Sequence]:
        """See `Scheduler.postprocess`."""
        if output.is_empty:
            return []
        if output is not self._in_flight:
            raise RuntimeError("postprocess() got an output other than the latest one from schedule()")
        self._in_flight = None
        if not isinstance(sampled_token_ids, Mapping) and not output.has_forks:
            updated = self._record_aligned(output, sampled_token_ids)
        else:
            updated = self._record_by_seq_id(output, sampled_token_ids)
        max_model_len = self.max_model_len
        for seq in updated:
            status = stop_checker(seq) if stop_checker else None
            if status is None and len(seq.all_token_ids) >= max_model_len:
                status = SequenceStatus.FINISHED_LENGTH
            if status is not None and seq.status not in FINISHED_STATUSES:
                self._finish(seq, status)
        return updated

    def advance(self, output: SchedulerOutput) -> None:
        """See `Scheduler.advance`."""
        if output.is_empty:
            return
        if output is not self._in_flight:
            raise RuntimeError("advance() got an output other than the latest one from schedule()")
        if output.has_forks:
            raise ValueError("a step with forks is recorded by postprocess(); it cannot overlap the next one")
        self._in_flight = None
        row = 0
        for entry in output.scheduled:
            seq = entry.seq
            if seq.status is RUNNING:
                seq.num_computed_tokens = entry.start_position + entry.num_new_tokens
                if entry.sample:
                    seq.all_token_ids.append(stand_in_token(row))
            row += entry.sample

    def resolve(
        self, output: SchedulerOutput, sampled_token_ids: Seq[int], token_checker: TokenChecker | None
    ) -> list[Sequence]:
        """See `Scheduler.resolve`."""
        if len(sampled_token_ids) != len(output.sampled_seqs):
            raise ValueError(
                f"got {len(sampled_token_ids)} sampled tokens for {len(output.sampled_seqs)} sampled sequences; "
                "pass one token per output.sampled_seqs entry"
            )
        cache_full_blocks, indexed = self._blocks.kv.cache_full_blocks, self._blocks.indexed
        block_size = self._blocks.kv.block_size
        got: list[tuple[Sequence, int, int]] = []  # (sequence, token, its index)
        index = 0
        for entry in output.scheduled:
            seq = entry.seq
            num_new = entry.num_new_tokens
            seq_len = entry.start_position + num_new
            status = seq.status
            if entry.sample:
                token = int(sampled_token_ids[index])
                index += 1
                if status is not RUNNING and status in FINISHED_STATUSES:
                    del seq.all_token_ids[seq_len:]  # the stand-in (and any later one)
                    continue
                seq.all_token_ids[seq_len] = token
                got.append((seq, token, seq_len))
            if status is not RUNNING:
                continue  # finished, or preempted: its blocks are gone
            seq_id = seq.seq_id
            if num_new == 1 and seq_len % block_size and seq_id in indexed:
                continue  # no block became full
            cache_full_blocks(seq_id, seq.all_token_ids, seq_len)
            indexed.add(seq_id)
        max_model_len = self.max_model_len
        finish = self._finish
        updated: list[Sequence] = []
        for seq, token, position in got:
            updated.append(seq)
            if seq.status is not RUNNING and seq.status in FINISHED_STATUSES:
                continue  # a stop checked earlier in this loop ended it (its request aborted)
            status = token_checker(seq, token) if token_checker else None
            if status is None and position + 1 >= max_model_len:
                status = SequenceStatus.FINISHED_LENGTH
            if status is not None and seq.status not in FINISHED_STATUSES:
                del seq.all_token_ids[position + 1 :]  # a later step's stand-in: never resolved
                finish(seq, status)
        return updated

    def _record_aligned(self, output: SchedulerOutput, sampled: Seq[int]) -> list[Sequence]:
        """Record a step without forks: `sampled` holds one token per sampling entry, in order."""
        scheduled = output.scheduled
        num_sampling = sum(1 for entry in scheduled if entry.sample)
        if len(sampled) != num_sampling:
            raise ValueError(
                f"got {len(sampled)} sampled tokens for {num_sampling} sampled sequences; "
                "pass one token per output.sampled_seqs entry (or a dict keyed by seq_id)"
            )
        cache_full_blocks, indexed = self._blocks.kv.cache_full_blocks, self._blocks.indexed
        block_size = self._blocks.kv.block_size
        updated: list[Sequence] = []
        index = 0
        for entry in scheduled:
            seq = entry.seq
            seq_len = entry.start_position + entry.num_new_tokens
            if entry.sample:
                token = int(sampled[index])
                index += 1
                if seq.status in FINISHED_STATUSES:
                    continue  # aborted while the step ran
                seq.num_computed_tokens = seq_len
                seq.all_token_ids.append(token)
                updated.append(seq)
            elif seq.status in FINISHED_STATUSES:
                continue
            else:
                seq.num_computed_tokens = seq_len
            seq_id = seq.seq_id
            if entry.num_new_tokens == 1 and seq_len % block_size and seq_id in indexed:
                continue  # no block became full: cache_full_blocks would return at once
            cache_full_blocks(seq_id, seq.all_token_ids, seq_len)
            indexed.add(seq_id)
        return updated

    def _record_by_seq_id(self, output: SchedulerOutput, sampled_token_ids: Mapping[str, int] | Seq[int]) -> list[Sequence]:
        """Record a step with forks, or with tokens keyed by seq_id."""
        tokens = _tokens_by_seq_id(output, sampled_token_ids)
        updated: list[Sequence] = []
        for entry in output.scheduled:
            seq = entry.seq
            if seq.is_finished:
                continue  # aborted while the step ran
            seq.num_computed_tokens = entry.seq_len
            if entry.sample:
                seq.append_token(_token(tokens, seq))
                updated.append(seq)
            self._blocks.index_full_blocks(seq)
            if entry.sample:
                updated.extend(self._fork_pending(seq, tokens))
        return updated

    def _fork_pending(self, leader: Sequence, tokens: Mapping[str, int]) -> list[Sequence]:
        """Start the samples waiting on `leader`'s prefill: shared blocks, their first tokens."""
        children = self._queues.take_forks(leader.seq_id)
        for child in children:
            self._blocks.kv.fork(leader.seq_id, child.seq_id)
            child.num_computed_tokens = leader.num_computed_tokens
            child.append_token(_token(tokens, child))
            self._queues.start_running(child)
        return children


def _tokens_by_seq_id(output: SchedulerOutput, sampled: Mapping[str, int] | Seq[int]) -> Mapping[str, int]:
    if isinstance(sampled, Mapping):
        return sampled
    expected = output.sampled_seqs
    if len(sampled) != len(expected):
        raise ValueError(
            f"got {len(sampled)} sampled tokens for {len(expected)} sampled sequences; "
            "pass one token per output.sampled_seqs entry (or a dict keyed by seq_id)"
        )
    return {seq.seq_id: int(token) for seq, token in zip(expected, sampled)}


def _token(tokens: Mapping[str, int], seq: Sequence) -> int:
    try:
        return int(tokens[seq.seq_id])
    except KeyError:
        raise KeyError(f"no sampled token for {seq.seq_id}; every entry of output.sampled_seqs needs one") from None
