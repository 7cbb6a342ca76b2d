"""Continuous-batching scheduler: which sequences run this step, with how many tokens, and
what their sampled tokens change.

Interface (one engine step):

    output = scheduler.schedule()                  # SchedulerOutput, typed, CPU only
    runner.copy_blocks(output.block_copies)        # copy-on-write, before the forward
    tokens = runner.execute(output)                # one token per output.sampled_seqs entry
    scheduler.advance(output)                      # the step's tokens count as computed
    updated = scheduler.resolve(output, tokens, token_checker)   # sampled ids, stops, frees

Tokens come back one way, `advance` then `resolve`. A synchronous step calls them back to
back. An overlapped step plans and launches the next step between them, before this one's
tokens reach the host:

    output = scheduler.schedule(); launch(output)
    scheduler.advance(output)            # stand-in ids for the samples
    next_output = scheduler.schedule()   # plans from the stand-ins; launch(next_output)
    scheduler.resolve(output, tokens, token_checker)   # real ids, stop checks, frees

`schedule()` fills a token budget (`max_num_batched_tokens`) with at most `max_num_seqs`
sequences: first every running sequence, decodes (1 token) before unfinished prefills, then
waiting sequences in (priority, arrival) order, each possibly resuming from a prefix-cache
hit. A sequence whose prompt KV arrived from elsewhere (`add_prefilled`) waits for a seat
holding its blocks and takes a free one before any waiting prompt. A prompt longer than what
is left of the budget is cut into chunks; the rest continues next step, ahead of new
arrivals. When KV blocks run out, the running sequence with the lowest priority (highest
number), latest arrival, is preempted: its blocks are freed, it goes back to waiting with
`num_computed_tokens = 0`, and its prompt *and* generated tokens are recomputed on
readmission. A step that preempted admits nobody new. A pure decode step
(nothing waits, no fork pending, one free block per sequence) is planned in one pass.

For each `ScheduledSequence` the runner feeds `token_ids` at positions `start_position ..
start_position + num_new_tokens - 1` using `block_table`, and computes logits only where
`sample` is True (the entry's last token; prefill complete). The sampler draws one token
per sequence in `entry.sample_seqs` from that row: the sequence itself, then any `forks`.

`advance` counts every entry's tokens as computed and puts a stand-in
(`stand_in_token(row)`, negative) where each sampled token will go; the runner feeds a
stand-in from the tokens the launched step sampled on the device. A sequence whose stand-in
is its last token (`Sequence.max_num_tokens`: max_tokens, the context, or a prefill-only
request's first token) sits out every later plan, keeping its blocks and never preempted,
until `resolve` ends it. `resolve` writes the real
ids over the stand-ins, indexes newly full blocks in the prefix cache, then asks
`token_checker(seq, token)` whether each sequence that got a token should finish; the
scheduler frees finished sequences' blocks. A sequence that ended after the launch (abort,
or a stop found by resolving the step before) drops its token and any later stand-in.

Sliding window: when every attention layer sees only a query's last W keys
(`kv.sliding_window`), `resolve` releases the blocks behind the window
(`kv.drop_outside_window`) of each running sequence whose entry fed a generated token. Such
a sequence generates here and its prompt KV is complete, so neither a prompt still being
prefilled in chunks, nor a prefill-only request's exported prompt (it ends on its first
token, which no step feeds), nor a reservation not yet received loses a block. A long
generation then holds at most ceil(W / block_size) + 1 blocks. With a window group (a cache
pairing sliding layers with full ones, `cleave.kv.groups`) the same drops apply to the
window tables alone, which entries carry beside their block tables (`window_table`), and
begin with a prompt's first chunk: a hand-off of its KV never sends the window pages behind
the window (`KVHandoff.num_unseen_pages`), so a prompt prefilled in chunks holds about
(chunk + W) / block_size window pages, not one per block.

n parallel samples (`add_group`) prefill the prompt once: the first sample runs alone; the
step its prefill completes, the others appear as its `forks`, draw their first tokens from
its logits, and in `advance` take shared references to its blocks (the last, partly filled
block is copied on the first write, reported in `block_copies`).

The engine can also end a sequence with `finish(seq_id, status)`, or a whole request with
`abort(request_id)`. `finished_seq_ids` in the next output lists every sequence that ended
since the previous one, so the runner can drop per-sequence state.

The waiting/running queues and fork and request groups live in `scheduler_queues`; the plan
types in `scheduler_output`; the blocks themselves in `cleave.kv.manager.KVCacheManager`.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Sequence as Seq

from cleave.engine.config import SchedulerConfig
from cleave.engine.scheduler_output import ScheduledSequence, SchedulerOutput, SchedulerStats, stand_in_token
from cleave.engine.scheduler_queues import SequenceQueues
from cleave.engine.sequence import FINISHED_STATUSES, RUNNING, Sequence, SequenceStatus
from cleave.kv.manager import NO_HIT, KVCacheManager

__all__ = ["ScheduledSequence", "Scheduler", "SchedulerOutput", "SchedulerStats", "TokenChecker"]

TokenChecker = Callable[[Sequence, int], "SequenceStatus | None"]
"""Returns a FINISHED_* status when a sequence that just got `token` should stop, else None.
It gets the token because the sequence may already hold a later step's stand-in."""

PREEMPTED = SequenceStatus.PREEMPTED


class Scheduler:
    """Admits sequences, plans each step within the token budget and KV capacity, and
    records its results. See the module docstring for the step protocol."""

    def __init__(self, config: SchedulerConfig, kv_manager: KVCacheManager) -> None:
        if kv_manager.num_blocks_for(config.max_model_len) > kv_manager.num_usable_blocks:
            raise ValueError(
                f"a {config.max_model_len}-token sequence needs {kv_manager.num_blocks_for(config.max_model_len)} "
                f"KV blocks{' (pages of its block and window tables)' if kv_manager.window_group else ''} but the "
                f"cache has {kv_manager.num_usable_blocks}; lower max_model_len or add blocks"
            )
        self.config = config
        self.kv = kv_manager
        self.stats = SchedulerStats()
        self._queues = SequenceQueues(config.max_model_len)
        # Sequences whose full blocks are indexed in the prefix cache up to their computed
        # tokens: a decode that completes no block has nothing new to index.
        self._indexed: set[str] = set()
        self._in_flight: SchedulerOutput | None = None  # planned with work, not advanced yet
        # Running sequences at their `max_num_tokens`, the last token not resolved yet: they
        # sit out every step until `resolve` ends them.
        self._done: set[str] = set()

    # ---- admission ------------------------------------------------------------------------

    @property
    def waiting(self) -> list[Sequence]:
        """Sequences waiting to (re)start, in priority order: the head is admitted next (read-only)."""
        return self._queues.waiting

    @property
    def running(self) -> list[Sequence]:
        """Sequences holding KV blocks, in admission order (read-only)."""
        return self._queues.running

    @property
    def num_waiting(self) -> int:
        return self._queues.num_waiting

    @property
    def num_running(self) -> int:
        return len(self._queues.running)

    @property
    def num_parked(self) -> int:
        """Received sequences waiting for a seat (`add_prefilled`)."""
        return len(self._queues.parked)

    @property
    def num_waiting_for_seat(self) -> int:
        """Waiting prompts and received sequences: lengths only, so safe to read from another
        thread while the step thread runs (`num_waiting` walks the pending forks' dict)."""
        return len(self._queues.waiting) + len(self._queues.parked)

    def num_preempted_ahead_of(self, priority: int) -> int:
        """Preempted sequences waiting to be recomputed whose priority value is at most
        `priority` (a decode worker's new reservations wait for them: `KVHandoff.reserve`)."""
        return sum(1 for seq in self._queues.waiting if seq.status is PREEMPTED and seq.priority <= priority)

    def has_unfinished(self) -> bool:
        return self._queues.has_unfinished()

    def add(self, seq: Sequence) -> None:
        """Queue a new sequence (status WAITING, nothing computed)."""
        self._queues.add(seq)

    def add_group(self, seqs: Seq[Sequence]) -> None:
        """Queue n samples of one prompt: seqs[0] prefills it, the rest are forked from it."""
        self._queues.add_group(seqs)

    def add_prefilled(self, seq: Sequence) -> None:
        """Queue for decoding a sequence whose KV is already in the cache under `seq.seq_id`.

        For a decode worker: blocks come from `kv.reserve`, the prefill worker's KV fills
        them, `seq.num_computed_tokens` counts those tokens and the first sampled token has
        been appended (so exactly one token is left to feed). It waits in `parked`, holding
        its blocks, until the batch has a seat (`max_num_seqs`): seated in priority order at
        the next `schedule()`, ahead of waiting prompts, since it needs no new blocks to run.
        """
        if self._queues.is_added(seq.seq_id):
            raise ValueError(f"sequence {seq.seq_id} was already added")
        if self.kv.num_tokens(seq.seq_id) != seq.num_computed_tokens or seq.num_uncomputed_tokens < 1:
            raise ValueError(
                f"{seq.seq_id}: {self.kv.num_tokens(seq.seq_id)} reserved KV slots, {seq.num_computed_tokens} "
                f"computed and {seq.num_tokens} total tokens; reserve exactly the computed tokens and append "
                "the first sampled token before admitting"
            )
        self._queues.register(seq)
        self._queues.park(seq)

    def abort(self, request_id: str) -> list[Sequence]:
        """End every sample of a request (FINISHED_ABORTED) and free its blocks."""
        seqs = [seq for seq in self._queues.request_seqs(request_id) if not seq.is_finished]
        for seq in seqs:
            self._finish(seq, SequenceStatus.FINISHED_ABORTED, promote_forks=False)
        return seqs

    def finish(self, seq_id: str, status: SequenceStatus) -> Sequence:
        """End one sequence with a FINISHED_* status (e.g. a stop string found downstream)."""
        if not status.is_finished:
            raise ValueError(f"{status} is not a finished status")
        request_id = seq_id.rsplit("/", 1)[0]
        for seq in self._queues.request_seqs(request_id):
            if seq.seq_id == seq_id:
                self._finish(seq, status)
                return seq
        raise KeyError(f"no unfinished sequence {seq_id!r}")

    # ---- one step -------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Plan the next step. Call `advance` with the result before scheduling again."""
        if self._in_flight is not None:
            raise RuntimeError("the previous SchedulerOutput was not advanced; call advance() first")
        if self._queues.parked:
            self._seat_parked()
        output = self._plan_decodes()
        if output is None:
            output = self._plan()
        self._in_flight = output if output.scheduled else None
        return output

    def advance(self, output: SchedulerOutput) -> None:
        """Record a planned step before its tokens are known (see the module docstring).

        Every entry's tokens count as computed and each sequence that samples gets the
        stand-in `stand_in_token(row)`, row being its index in `output.sampled_seqs`; a
        leader's forks start running on shared blocks. `schedule` may run again at once.
        """
        if output.is_empty:
            return
        if output is not self._in_flight:
            raise RuntimeError("advance() got an output other than the latest one from schedule()")
        self._in_flight = None
        row = 0
        for entry in output.scheduled:
            seq = entry.seq
            if seq.status is RUNNING:  # not ended since the plan
                seq.num_computed_tokens = entry.start_position + entry.num_new_tokens
                if entry.sample:
                    seq.all_token_ids.append(stand_in_token(row))
                    self._sit_out_if_done(seq)
                    if entry.forks:
                        self._start_forks(seq, entry.forks, row)
            if entry.sample:
                row += 1 + len(entry.forks)

    def resolve(
        self,
        output: SchedulerOutput,
        sampled_token_ids: Seq[int],
        token_checker: TokenChecker | None = None,
    ) -> list[Sequence]:
        """Record the tokens of a step recorded by `advance`; returns the sequences that got
        one, in sampled order (those that finished are already freed).

        `sampled_token_ids` holds one token per `output.sampled_seqs` entry. The token of a
        sequence that ended after the launch (abort, or a stop found by resolving the step
        before) is dropped; a sequence preempted after the launch keeps it for its recompute.
        """
        if len(sampled_token_ids) != len(output.sampled_seqs):
            raise ValueError(
                f"got {len(sampled_token_ids)} sampled tokens for {len(output.sampled_seqs)} sampled sequences; "
                "pass one token per output.sampled_seqs entry"
            )
        kv, indexed = self.kv, self._indexed
        cache_full_blocks, block_size = kv.cache_full_blocks, kv.block_size
        sliding_window = kv.sliding_window
        drops_in_prefill = kv.window_group  # its hand-offs never send the pages behind the window
        has_forks = output.has_forks
        got: list[tuple[Sequence, int, int]] = []  # (sequence, token, its position)
        index = 0
        for entry in output.scheduled:
            seq = entry.seq
            num_new = entry.num_new_tokens
            seq_len = entry.start_position + num_new
            status = seq.status
            if entry.sample:
                if has_forks and entry.forks:
                    for sampled in entry.sample_seqs:
                        _take_token(sampled, int(sampled_token_ids[index]), seq_len, got)
                        index += 1
                else:  # the common case, inlined: _take_token(seq, ...)
                    token = int(sampled_token_ids[index])
                    index += 1
                    if status is RUNNING or status is PREEMPTED:
                        seq.all_token_ids[seq_len] = token
                        got.append((seq, token, seq_len))
                    else:
                        del seq.all_token_ids[seq_len:]
            if status is not RUNNING:
                continue  # finished, or preempted: its blocks are gone
            seq_id = seq.seq_id
            # A decode that filled no block has nothing new to index.
            if num_new != 1 or not seq_len % block_size or seq_id not in indexed:
                cache_full_blocks(seq_id, seq.all_token_ids, seq_len, seq.hash_root)
                indexed.add(seq_id)
            if sliding_window and (seq_len > seq.num_prompt_tokens or drops_in_prefill):
                # The next step's queries, launched already or not, start at seq_len.
                kv.drop_outside_window(seq_id, seq_len)
        max_model_len = self.config.max_model_len
        updated: list[Sequence] = []
        for seq, token, position in got:
            updated.append(seq)
            if seq.status is not RUNNING and seq.status in FINISHED_STATUSES:
                continue  # a stop checked earlier in this loop ended it (its request aborted)
            status = token_checker(seq, token) if token_checker else None
            if status is None and (position + 1 >= max_model_len or position + 1 >= seq.max_num_tokens):
                status = SequenceStatus.FINISHED_LENGTH
            if status is not None and seq.status not in FINISHED_STATUSES:
                del seq.all_token_ids[position + 1 :]  # a later step's stand-in: never resolved
                self._finish(seq, status)
        return updated

    # ---- planning -------------------------------------------------------------------------

    def _plan(self) -> SchedulerOutput:
        """Allocate the next step's KV slots and return its plan (possibly empty)."""
        queues = self._queues
        budget = self.config.max_num_batched_tokens
        planned: dict[str, tuple[Sequence, int]] = {}
        preempted: list[str] = []

        threshold = self.config.long_prefill_token_threshold
        decodes_first = sorted(queues.running, key=lambda s: (s.num_uncomputed_tokens > 1, queues.priority_key(s)))
        done = self._done
        for seq in decodes_first:
            if budget == 0 or len(planned) >= self.config.max_num_seqs:
                break
            if seq.status is not RUNNING or seq.seq_id in done:
                continue  # preempted earlier in this loop, or its last token is sampled
            num_new = min(seq.num_uncomputed_tokens, budget, threshold or budget)
            victims = self._allocate_or_preempt(seq, num_new)
            for victim in victims:
                preempted.append(victim.seq_id)
                if victim.seq_id in planned:
                    budget += planned.pop(victim.seq_id)[1]
            if not victims or victims[-1] is not seq:
                planned[seq.seq_id] = (seq, num_new)
                budget -= num_new

        if not preempted:
            budget = self._admit_waiting(budget, planned)
            if threshold and budget:
                self._top_up_long_prefills(budget, planned)

        self.stats.num_steps += 1
        return SchedulerOutput(
            scheduled=[self._entry(seq, num_new) for seq, num_new in planned.values()],
            block_copies=self.kv.take_pending_copies(),
            preempted_seq_ids=preempted,
            finished_seq_ids=queues.take_finished(),
        )

    def _plan_decodes(self) -> SchedulerOutput | None:
        """The plan of a pure decode step in one pass, or None when `_plan` is needed.

        Most steps of a busy engine are pure decodes. Applies when nothing waits, no fork is
        pending, the running sequences fit the step's limits, each has exactly one token to
        feed and the pool has a free block per sequence (a decode needs at most one: a new
        block at a boundary or a copy-on-write of a shared last block). The plan is then
        exactly `_plan`'s, and nobody is preempted; otherwise nothing is allocated.
        """
        queues, config, kv, done = self._queues, self.config, self.kv, self._done
        running = queues.running
        num_running = len(running) - len(done)
        if (
            not num_running
            or queues.waiting
            or queues.pending_forks
            or num_running > config.max_num_seqs
            or num_running > config.max_num_batched_tokens
        ):
            return None
        order = queues.running_order()
        if done:
            order = [seq for seq in order if seq.seq_id not in done]
        starts = [len(seq.all_token_ids) - 1 for seq in order]
        if starts != [seq.num_computed_tokens for seq in order]:
            return None  # a sequence has more than one token to feed
        tables = kv.allocate_decode_slots([seq.seq_id for seq in order])
        if tables is None:
            return None
        scheduled: list[ScheduledSequence] = []
        num_decodes = 0
        window_view = kv.window_table_view if kv.window_group else None
        for seq, start, table in zip(order, starts, tables):
            is_decode = start >= seq.num_prompt_tokens  # else the last prompt token of a recompute
            num_decodes += is_decode
            token_ids = seq.all_token_ids[start:]
            window = window_view(seq.seq_id) if window_view is not None else None
            scheduled.append(ScheduledSequence(seq, 1, token_ids, start, True, table, (), not is_decode, window))
        stats = self.stats
        stats.num_steps += 1
        stats.num_decode_tokens += num_decodes
        stats.num_prefill_tokens += num_running - num_decodes
        return SchedulerOutput(scheduled, kv.take_pending_copies(), [], queues.take_finished())

    def _seat_parked(self) -> None:
        """Move received sequences from `parked` to `running` while the batch has seats, in
        priority order. Before waiting prompts whatever their priority: a parked sequence
        holds its blocks already, so seating it can never wait on a prompt that waits for
        blocks it holds."""
        queues = self._queues
        parked = queues.parked
        free = self.config.max_num_seqs - queues.reserved_seats()
        while parked and free > 0:
            queues.start_running(parked.pop(0))
            free -= 1

    def _admit_waiting(self, budget: int, planned: dict[str, tuple[Sequence, int]]) -> int:
        """Admit waiting sequences in priority order while budget, seats and blocks last;
        returns the budget left."""
        queues, kv, config, stats = self._queues, self.kv, self.config, self.stats
        threshold = config.long_prefill_token_threshold
        pending_forks = queues.pending_forks
        seats = queues.reserved_seats()
        while queues.waiting and budget > 0 and len(planned) < config.max_num_seqs:
            seq = queues.waiting[0]
            group_size = 1 + len(pending_forks.get(seq.seq_id, ()))
            if seats + group_size > config.max_num_seqs:
                break
            # prompt logprobs need every prompt position's logits: no prefix-cache hit
            wants_prompt_logprobs = getattr(seq.sampling_params, "prompt_logprobs", None) is not None
            hit = NO_HIT if wants_prompt_logprobs else kv.get_computed_blocks(seq.seq_id, seq.all_token_ids,
                                                                              seq.hash_root)
            num_new = seq.num_tokens - hit.num_computed_tokens
            if num_new > budget:
                if not config.enable_chunked_prefill:
                    break
                num_new = budget
            if threshold and num_new > threshold and config.enable_chunked_prefill:
                num_new = threshold  # shorter prompts behind it are admitted first
            if not kv.allocate_slots(seq.seq_id, num_new, hit):
                break
            queues.waiting.pop(0)
            seq.num_computed_tokens = hit.num_computed_tokens
            seq.num_cached_tokens = hit.num_computed_tokens
            stats.num_prefix_cache_hit_tokens += hit.num_computed_tokens
            if kv.enable_prefix_caching:
                stats.num_prefix_cache_query_tokens += seq.num_tokens
            queues.start_running(seq)
            seats += group_size
            planned[seq.seq_id] = (seq, num_new)
            budget -= num_new
        return budget

    def _top_up_long_prefills(self, budget: int, planned: dict[str, tuple[Sequence, int]]) -> None:
        """Give the step's leftover budget back to the prompts `long_prefill_token_threshold`
        held back, in priority order (no preemption for it: a top-up the pool cannot hold is
        skipped)."""
        threshold, kv = self.config.long_prefill_token_threshold, self.kv
        held_back = sorted(
            (seq for seq, num_new in planned.values() if num_new == threshold and seq.num_uncomputed_tokens > num_new),
            key=self._queues.priority_key,
        )
        for seq in held_back:
            if budget == 0:
                return
            num_new = planned[seq.seq_id][1]
            extra = min(seq.num_uncomputed_tokens - num_new, budget)
            if kv.allocate_slots(seq.seq_id, extra):
                planned[seq.seq_id] = (seq, num_new + extra)
                budget -= extra

    def _entry(self, seq: Sequence, num_new: int) -> ScheduledSequence:
        start = seq.num_computed_tokens
        sample = start + num_new == seq.num_tokens
        is_decode = num_new == 1 and sample and seq.num_output_tokens > 0
        if is_decode:
            self.stats.num_decode_tokens += 1
        else:
            self.stats.num_prefill_tokens += num_new
        forks = tuple(self._queues.pending_forks.get(seq.seq_id, ())) if sample else ()
        return ScheduledSequence(
            seq=seq,
            num_new_tokens=num_new,
            token_ids=seq.all_token_ids[start : start + num_new],
            start_position=start,
            sample=sample,
            block_table=self.kv.block_table_view(seq.seq_id),
            forks=forks,
            is_prefill=not is_decode,
            window_table=self.kv.window_table_view(seq.seq_id) if self.kv.window_group else None,
        )

    # ---- blocks ---------------------------------------------------------------------------

    def _allocate_or_preempt(self, seq: Sequence, num_new: int) -> list[Sequence]:
        """Allocate `num_new` slots for a running sequence, preempting until they fit.

        Returns the preempted sequences in order (empty when the slots fitted at once). When
        `seq` itself is preempted it is the last one, and nothing was allocated for it.
        """
        preempted: list[Sequence] = []
        queues = self._queues
        done = self._done
        while not self.kv.allocate_slots(seq.seq_id, num_new):
            # not one whose last token is sampled: its end (a prefill-only export) needs its blocks
            victim = max((other for other in queues.running if other.seq_id not in done), key=queues.priority_key)
            self._release(victim.seq_id)
            queues.requeue(victim)
            self.stats.num_preemptions += 1
            preempted.append(victim)
            if victim is seq:
                break
        return preempted

    def _start_forks(self, leader: Sequence, forks: tuple[Sequence, ...], row: int) -> None:
        """Start the samples waiting on `leader`'s just-completed prefill: each shares its
        blocks and holds the stand-in of its own row (the leader's row + 1, + 2, ...).

        The prompt's full blocks are indexed first so the samples share the index too; the
        prompt holds no stand-in, so its hashes are final already.
        """
        leader_id, num_computed = leader.seq_id, leader.num_computed_tokens
        self.kv.cache_full_blocks(leader_id, leader.all_token_ids, num_computed, leader.hash_root)
        self._indexed.add(leader_id)
        pending = self._queues.take_forks(leader_id)
        for offset, child in enumerate(forks, 1):
            if child not in pending:
                continue  # ended since the plan: it drops its token in `resolve`
            self.kv.fork(leader_id, child.seq_id)
            child.num_computed_tokens = num_computed
            child.all_token_ids.append(stand_in_token(row + offset))
            self._queues.start_running(child)
            self._sit_out_if_done(child)

    def _sit_out_if_done(self, seq: Sequence) -> None:
        """A sequence whose newest (stand-in) token is its last runs in no further step."""
        if len(seq.all_token_ids) >= seq.max_num_tokens:
            self._done.add(seq.seq_id)

    def _finish(self, seq: Sequence, status: SequenceStatus, promote_forks: bool = True) -> None:
        self._queues.finish(seq, status, promote_forks)
        self._release(seq.seq_id)

    def _release(self, seq_id: str) -> None:
        """Drop a sequence's blocks (finished or preempted); cached full blocks stay reusable."""
        self.kv.free(seq_id)
        self._indexed.discard(seq_id)
        self._done.discard(seq_id)


def _take_token(seq: Sequence, token: int, position: int, got: list[tuple[Sequence, int, int]]) -> None:
    """Write a sampled token over its stand-in, or drop it (and any later stand-in) when the
    sequence ended after the launch, or is a fork whose leader ended before it forked."""
    status = seq.status
    if status is RUNNING or status is PREEMPTED:
        seq.all_token_ids[position] = token
        got.append((seq, token, position))
    else:
        del seq.all_token_ids[position:]
