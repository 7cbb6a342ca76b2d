"""Continuous-batching scheduler: which sequences run this step, with how many tokens.

Interface (one engine step):

    output = scheduler.schedule()                  # SchedulerOutput, typed, CPU only
    runner.copy_blocks(output.block_copies)        # copy-on-write, before the forward
    tokens = runner.execute(output)                # one token per output.sampled_seqs entry
    updated = scheduler.postprocess(output, tokens, stop_checker)

`schedule()` fills a token budget (`max_num_batched_tokens`) with at most `max_num_seqs`
sequences: first every running sequence, decodes (1 token) before unfinished prefills, then
waiting sequences in (priority, arrival) order, each possibly resuming from a prefix-cache
hit. A prompt longer than what is left of the budget is cut into chunks; the rest continues
next step, ahead of new arrivals. When KV blocks run out, the running sequence with the
lowest priority (highest number), latest arrival, is preempted: its blocks are freed, it goes
back to waiting with `num_computed_tokens = 0`, and its prompt *and* generated tokens are
recomputed on readmission. A step that preempted admits nobody new.

For each `ScheduledSequence` the runner feeds `token_ids` at positions `start_position ..
start_position + num_new_tokens - 1` using `block_table`, and computes logits only where
`sample` is True (the entry's last token; prefill complete). The sampler draws one token
per sequence in `entry.sample_seqs` from that row: the sequence itself, then any `forks`.

n parallel samples (`add_group`) prefill the prompt once: the first sample runs alone; the
step its prefill completes, the others appear as its `forks`, draw their first tokens from
its logits, and in `postprocess` take shared references to its blocks (the last, partly
filled block is copied on the first write, reported in `block_copies`).

`postprocess` records the step (computed tokens, sampled tokens, newly full blocks in the
prefix cache), then asks `stop_checker(seq)` whether each sequence that got a token should
finish; the scheduler frees finished sequences' blocks. The engine can also end a sequence
later with `finish(seq_id, status)`, or a whole request with `abort(request_id)`.
`finished_seq_ids` in the next output lists every sequence that ended since the previous
one, so the runner can drop per-sequence state.

Overlapped steps split `postprocess` in two, so the next step can be planned and launched
before this one's tokens reach the host:

    output = scheduler.schedule(); launch(output)
    scheduler.advance(output)        # tokens count as computed; stand-in ids for samples
    next_output = scheduler.schedule()   # plans from the stand-ins; launch(next_output)
    scheduler.resolve(output, tokens, token_checker)   # real ids, stop checks, frees

A stand-in (`stand_in_token(row)`, negative) sits where the sampled token will go; the
runner feeds the sampled token itself on the device. A sequence that `resolve` finishes may
already hold a stand-in of the next launched step: resolving that step drops it.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Mapping
from collections.abc import Sequence as Seq

from cleave.engine.config import SchedulerConfig
from cleave.engine.decode_plan import plan_decodes
from cleave.engine.scheduler_output import ScheduledSequence, SchedulerOutput, SchedulerStats, stand_in_token
from cleave.engine.sequence import FINISHED_STATUSES, Sequence, SequenceStatus
from cleave.errors import InvalidArgument
from cleave.kv.manager import KVCacheManager

__all__ = ["ScheduledSequence", "Scheduler", "SchedulerOutput", "SchedulerStats", "StopChecker", "TokenChecker"]

StopChecker = Callable[[Sequence], "SequenceStatus | None"]
"""Returns a FINISHED_* status when a sequence that just got a token should stop, else None."""

TokenChecker = Callable[[Sequence, int], "SequenceStatus | None"]
"""`StopChecker` of `resolve`: also gets the token (the sequence may hold later stand-ins)."""


class Scheduler:
    """Admits sequences, plans each step within the token budget and KV capacity, and
    records its results. See the module docstring for the step protocol."""

    def __init__(self, config: SchedulerConfig, kv_manager: KVCacheManager) -> None:
        if kv_manager.num_blocks_for(config.max_model_len) > kv_manager.num_usable_blocks:
            raise ValueError(
                f"a {config.max_model_len}-token sequence needs {kv_manager.num_blocks_for(config.max_model_len)} "
                f"KV blocks but the cache has {kv_manager.num_usable_blocks}; lower max_model_len or add blocks"
            )
        self.config = config
        self.kv = kv_manager
        self.stats = SchedulerStats()
        self.waiting: list[Sequence] = []  # sorted by _priority_key
        self.running: list[Sequence] = []
        self._pending_forks: dict[str, list[Sequence]] = {}  # leader seq_id -> samples to fork
        self._requests: dict[str, list[Sequence]] = {}
        self._add_order: dict[str, int] = {}
        self._next_order = 0
        self._finished_since_output: list[str] = []
        self._in_flight: SchedulerOutput | None = None
        # `running` sorted by _priority_key, rebuilt after `running` changes (decode fast path).
        self._running_order: list[Sequence] | None = None
        # Sequences whose full blocks were indexed up to their computed tokens by the previous
        # postprocess: a decode that does not complete a block has nothing new to index.
        self._blocks_indexed: set[str] = set()

    # ---- admission ------------------------------------------------------------------------

    @property
    def num_waiting(self) -> int:
        return len(self.waiting) + sum(len(forks) for forks in self._pending_forks.values())

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_unfinished(self) -> bool:
        return bool(self._requests)

    def add(self, seq: Sequence) -> None:
        """Queue a new sequence (status WAITING, nothing computed)."""
        self._check_new(seq)
        self._register(seq)
        bisect.insort(self.waiting, seq, key=self._priority_key)

    def add_group(self, seqs: Seq[Sequence]) -> None:
        """Queue n samples of one prompt: seqs[0] prefills it, the rest are forked from it."""
        if not seqs:
            raise ValueError("add_group needs at least one sequence")
        leader, *rest = seqs
        if len({seq.seq_id for seq in seqs}) != len(seqs):
            raise ValueError(f"samples of {leader.request_id} need distinct sample_index values")
        for seq in rest:
            if seq.request_id != leader.request_id or seq.all_token_ids != leader.all_token_ids:
                raise ValueError(f"{seq.seq_id} is not a sample of {leader.seq_id}: same request and prompt expected")
            self._check_new(seq)
        self.add(leader)
        for seq in rest:
            self._register(seq)
            seq.parent_seq_id = leader.seq_id
        if rest:
            self._pending_forks[leader.seq_id] = list(rest)

    def add_prefilled(self, seq: Sequence) -> None:
        """Start decoding a sequence whose KV is already in the cache under `seq.seq_id`.

        For a decode worker: blocks come from `kv.reserve`, the prefill worker's KV fills
        them, `seq.num_computed_tokens` counts those tokens and the first sampled token has
        been appended (so exactly one token is left to feed).
        """
        if seq.seq_id in self._add_order:
            raise ValueError(f"sequence {seq.seq_id} was already added")
        if self.kv.num_tokens(seq.seq_id) != seq.num_computed_tokens or seq.num_uncomputed_tokens < 1:
            raise ValueError(
                f"{seq.seq_id}: {self.kv.num_tokens(seq.seq_id)} reserved KV slots, {seq.num_computed_tokens} "
                f"computed and {seq.num_tokens} total tokens; reserve exactly the computed tokens and append "
                "the first sampled token before admitting"
            )
        self._register(seq)
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)
        self._running_order = None

    def abort(self, request_id: str) -> list[Sequence]:
        """End every sample of a request (FINISHED_ABORTED) and free its blocks."""
        seqs = [seq for seq in self._requests.get(request_id, ()) if not seq.is_finished]
        for seq in seqs:
            self._finish(seq, SequenceStatus.FINISHED_ABORTED, promote_forks=False)
        return seqs

    def finish(self, seq_id: str, status: SequenceStatus) -> Sequence:
        """End one sequence with a FINISHED_* status (e.g. a stop string found downstream)."""
        if not status.is_finished:
            raise ValueError(f"{status} is not a finished status")
        request_id = seq_id.rsplit("/", 1)[0]
        for seq in self._requests.get(request_id, ()):
            if seq.seq_id == seq_id:
                self._finish(seq, status, promote_forks=True)
                return seq
        raise KeyError(f"no unfinished sequence {seq_id!r}")

    # ---- one step -------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Plan the next step. Call `postprocess` with the result before scheduling again."""
        if self._in_flight is not None:
            raise RuntimeError("the previous SchedulerOutput was not postprocessed; call postprocess() first")
        output = self._schedule_decodes()
        if output is not None:
            return output
        budget = self.config.max_num_batched_tokens
        planned: dict[str, tuple[Sequence, int]] = {}
        preempted: list[str] = []

        decodes_first = sorted(self.running, key=lambda s: (s.num_uncomputed_tokens > 1, self._priority_key(s)))
        for seq in decodes_first:
            if budget == 0 or len(planned) >= self.config.max_num_seqs:
                break
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted earlier in this loop
            num_new = min(seq.num_uncomputed_tokens, budget)
            while not self.kv.allocate_slots(seq.seq_id, num_new):
                victim = max(self.running, key=self._priority_key)
                self._preempt(victim)
                preempted.append(victim.seq_id)
                if victim.seq_id in planned:
                    budget += planned.pop(victim.seq_id)[1]
                if victim is seq:
                    break
            else:
                planned[seq.seq_id] = (seq, num_new)
                budget -= num_new

        if not preempted:
            budget = self._admit_waiting(budget, planned)

        self.stats.num_steps += 1
        output = SchedulerOutput(
            scheduled=[self._entry(seq, num_new) for seq, num_new in planned.values()],
            block_copies=self.kv.take_pending_copies(),
            preempted_seq_ids=preempted,
            finished_seq_ids=self._finished_since_output,
        )
        self._finished_since_output = []
        self._in_flight = output if output.scheduled else None
        return output

    def postprocess(
        self,
        output: SchedulerOutput,
        sampled_token_ids: Mapping[str, int] | Seq[int],
        stop_checker: StopChecker | None = None,
    ) -> list[Sequence]:
        """Record a finished step; returns the sequences that got a token, in sampled order.

        `sampled_token_ids` maps seq_id to token, or lists one token per `output.sampled_seqs`.
        Returned sequences that finished (stop_checker, or max_model_len) are already freed.
        """
        if output.is_empty:
            return []
        if output is not self._in_flight:
            raise RuntimeError("postprocess() got an output other than the latest one from schedule()")
        self._in_flight = None
        if not isinstance(sampled_token_ids, Mapping) and not output.has_forks:
            updated = self._record_aligned(output, sampled_token_ids)
        else:
            updated = self._record_by_seq_id(output, sampled_token_ids)
        max_model_len = self.config.max_model_len
        for seq in updated:
            status = stop_checker(seq) if stop_checker else None
            if status is None and len(seq.all_token_ids) >= max_model_len:
                status = SequenceStatus.FINISHED_LENGTH
            if status is not None and seq.status not in FINISHED_STATUSES:
                self._finish(seq, status, promote_forks=True)
        return updated

    def advance(self, output: SchedulerOutput) -> None:
        """Record a launched step before its tokens are known (see the module docstring).

        Every entry's tokens count as computed and each sequence that samples gets the
        stand-in `stand_in_token(row)`, row being its index in `output.sampled_seqs`;
        `schedule` may run again at once. Steps with forks share blocks in `postprocess`
        and cannot be advanced.
        """
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
            if seq.status is SequenceStatus.RUNNING:
                seq.num_computed_tokens = entry.start_position + entry.num_new_tokens
                if entry.sample:
                    seq.all_token_ids.append(stand_in_token(row))
            row += entry.sample

    def resolve(
        self,
        output: SchedulerOutput,
        sampled_token_ids: Seq[int],
        token_checker: TokenChecker | None = None,
    ) -> list[Sequence]:
        """Record the tokens of a step recorded by `advance`; returns the sequences that got
        one, in sampled order (finished ones already freed), as `postprocess` does.

        `sampled_token_ids` holds one token per `output.sampled_seqs` entry. The token of a
        sequence that ended after the launch (abort, or a stop found by resolving the step
        before) is dropped; a sequence preempted after the launch keeps it for its recompute.
        """
        if len(sampled_token_ids) != len(output.sampled_seqs):
            raise ValueError(
                f"got {len(sampled_token_ids)} sampled tokens for {len(output.sampled_seqs)} sampled sequences; "
                "pass one token per output.sampled_seqs entry"
            )
        scheduled = output.scheduled
        cache_full_blocks, indexed = self.kv.cache_full_blocks, self._blocks_indexed
        block_size = self.kv.block_size
        got: list[tuple[Sequence, int, int]] = []  # (sequence, token, its index)
        index = 0
        for entry in scheduled:
            seq = entry.seq
            seq_len = entry.start_position + entry.num_new_tokens
            status = seq.status
            if entry.sample:
                token = int(sampled_token_ids[index])
                index += 1
                if status in FINISHED_STATUSES:
                    del seq.all_token_ids[seq_len:]  # the stand-in (and any later one)
                    continue
                seq.all_token_ids[seq_len] = token
                got.append((seq, token, seq_len))
            if status is not SequenceStatus.RUNNING:
                continue  # finished, or preempted: its blocks are gone
            seq_id = seq.seq_id
            if entry.num_new_tokens == 1 and seq_len % block_size and seq_id in indexed:
                continue  # no block became full
            cache_full_blocks(seq_id, seq.all_token_ids, seq_len)
            indexed.add(seq_id)
        max_model_len = self.config.max_model_len
        updated: list[Sequence] = []
        for seq, token, position in got:
            updated.append(seq)
            if seq.status in FINISHED_STATUSES:
                continue  # a stop checked earlier in this loop ended it (its request aborted)
            status = token_checker(seq, token) if token_checker else None
            if status is None and position + 1 >= max_model_len:
                status = SequenceStatus.FINISHED_LENGTH
            if status is not None and seq.status not in FINISHED_STATUSES:
                del seq.all_token_ids[position + 1 :]  # a later step's stand-in: never resolved
                self._finish(seq, status, promote_forks=True)
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
        cache_full_blocks, indexed = self.kv.cache_full_blocks, self._blocks_indexed
        block_size = self.kv.block_size
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
        tokens = self._tokens_by_seq_id(output, sampled_token_ids)
        updated: list[Sequence] = []
        for entry in output.scheduled:
            seq = entry.seq
            if seq.is_finished:
                continue  # aborted while the step ran
            seq.num_computed_tokens = entry.seq_len
            if entry.sample:
                seq.append_token(_token(tokens, seq))
                updated.append(seq)
            self.kv.cache_full_blocks(seq.seq_id, seq.all_token_ids, seq.num_computed_tokens)
            self._blocks_indexed.add(seq.seq_id)
            if entry.sample:
                updated.extend(self._fork_pending(seq, tokens))
        return updated

    # ---- internals ------------------------------------------------------------------------

    def _schedule_decodes(self) -> SchedulerOutput | None:
        """The plan of a pure decode step, or None when the general planner is needed.

        Applies when nothing waits, no fork is pending and every running sequence fits the
        step's limits; `plan_decodes` checks the rest (see `cleave.engine.decode_plan`).
        """
        running = self.running
        num_running = len(running)
        config = self.config
        if (
            not running
            or self.waiting
            or self._pending_forks
            or num_running > config.max_num_seqs
            or num_running > config.max_num_batched_tokens
        ):
            return None
        order = self._running_order
        if order is None:
            order = self._running_order = sorted(running, key=self._priority_key)
        plan = plan_decodes(order, self.kv)
        if plan is None:
            return None
        scheduled, num_decodes = plan
        stats = self.stats
        stats.num_steps += 1
        stats.num_decode_tokens += num_decodes
        stats.num_prefill_tokens += num_running - num_decodes
        output = SchedulerOutput(scheduled, self.kv.take_pending_copies(), [], self._finished_since_output)
        self._finished_since_output = []
        self._in_flight = output
        return output

    def _admit_waiting(self, budget: int, planned: dict[str, tuple[Sequence, int]]) -> int:
        reserved_forks = sum(len(self._pending_forks.get(s.seq_id, ())) for s in self.running)
        while self.waiting and budget > 0 and len(planned) < self.config.max_num_seqs:
            seq = self.waiting[0]
            group_size = 1 + len(self._pending_forks.get(seq.seq_id, ()))
            if len(self.running) + reserved_forks + group_size > self.config.max_num_seqs:
                break
            hit = self.kv.get_computed_blocks(seq.seq_id, seq.all_token_ids)
            num_new = seq.num_tokens - hit.num_computed_tokens
            if num_new > budget:
                if not self.config.enable_chunked_prefill:
                    break
                num_new = budget
            if not self.kv.allocate_slots(seq.seq_id, num_new, hit):
                break
            self.waiting.pop(0)
            seq.status = SequenceStatus.RUNNING
            seq.num_computed_tokens = hit.num_computed_tokens
            seq.num_cached_tokens = hit.num_computed_tokens
            self.stats.num_prefix_cache_hit_tokens += hit.num_computed_tokens
            self.running.append(seq)
            self._running_order = None
            reserved_forks += group_size - 1
            planned[seq.seq_id] = (seq, num_new)
            budget -= num_new
        return budget

    def _entry(self, seq: Sequence, num_new: int) -> ScheduledSequence:
        start = seq.num_computed_tokens
        sample = start + num_new == seq.num_tokens
        is_decode = num_new == 1 and sample and seq.num_output_tokens > 0
        if is_decode:
            self.stats.num_decode_tokens += 1
        else:
            self.stats.num_prefill_tokens += num_new
        forks = tuple(self._pending_forks.get(seq.seq_id, ())) if sample else ()
        return ScheduledSequence(
            seq=seq,
            num_new_tokens=num_new,
            token_ids=seq.all_token_ids[start : start + num_new],
            start_position=start,
            sample=sample,
            block_table=self.kv.block_table_view(seq.seq_id),
            forks=forks,
            is_prefill=not is_decode,
        )

    def _fork_pending(self, leader: Sequence, tokens: Mapping[str, int]) -> list[Sequence]:
        children = self._pending_forks.pop(leader.seq_id, [])
        for child in children:
            self.kv.fork(leader.seq_id, child.seq_id)
            child.num_computed_tokens = leader.num_computed_tokens
            child.append_token(_token(tokens, child))
            child.status = SequenceStatus.RUNNING
            self.running.append(child)
            self._running_order = None
        return children

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._running_order = None
        self.kv.free(seq.seq_id)
        self._blocks_indexed.discard(seq.seq_id)
        seq.status = SequenceStatus.PREEMPTED
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        self.stats.num_preemptions += 1
        bisect.insort(self.waiting, seq, key=self._priority_key)

    def _finish(self, seq: Sequence, status: SequenceStatus, promote_forks: bool) -> None:
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
            self._running_order = None
        elif seq in self.waiting:
            self.waiting.remove(seq)
        elif seq.parent_seq_id in self._pending_forks:
            pending = self._pending_forks[seq.parent_seq_id]
            pending.remove(seq)
            if not pending:
                del self._pending_forks[seq.parent_seq_id]
        seq.status = status
        self.kv.free(seq.seq_id)
        self._blocks_indexed.discard(seq.seq_id)
        self._finished_since_output.append(seq.seq_id)
        orphans = self._pending_forks.pop(seq.seq_id, [])
        if promote_forks and orphans:
            new_leader, *rest = orphans
            new_leader.parent_seq_id = None
            bisect.insort(self.waiting, new_leader, key=self._priority_key)
            for child in rest:
                child.parent_seq_id = new_leader.seq_id
            if rest:
                self._pending_forks[new_leader.seq_id] = rest
        group = self._requests[seq.request_id]
        group.remove(seq)
        if not group:
            del self._requests[seq.request_id]
        self._add_order.pop(seq.seq_id, None)

    def _check_new(self, seq: Sequence) -> None:
        if seq.seq_id in self._add_order:
            raise ValueError(f"sequence {seq.seq_id} was already added")
        if seq.status is not SequenceStatus.WAITING or seq.num_computed_tokens:
            raise ValueError(f"{seq.seq_id} must be new (WAITING, nothing computed) to be added")
        if seq.num_tokens >= self.config.max_model_len:
            raise InvalidArgument(
                f"prompt has {seq.num_tokens} tokens but max_model_len is {self.config.max_model_len}; "
                "shorten the prompt to leave room for at least one output token",
                field="prompt",
            )

    def _register(self, seq: Sequence) -> None:
        self._requests.setdefault(seq.request_id, []).append(seq)
        self._add_order[seq.seq_id] = self._next_order
        self._next_order += 1

    def _priority_key(self, seq: Sequence) -> tuple[int, float, int]:
        return (seq.priority, seq.arrival_time, self._add_order[seq.seq_id])

    def _tokens_by_seq_id(self, output: SchedulerOutput, sampled: Mapping[str, int] | Seq[int]) -> Mapping[str, int]:
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
