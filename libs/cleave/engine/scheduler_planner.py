"""The scheduler's step planner: which sequences run next step, with how many tokens.

`StepPlanner.plan` fills a token budget (`max_num_batched_tokens`) with at most
`max_num_seqs` sequences: first every running sequence, decodes (1 token) before unfinished
prefills, then waiting sequences in priority order, each possibly resuming from a
prefix-cache hit. A prompt longer than what is left of the budget is cut into chunks
(`enable_chunked_prefill`). When KV blocks run out, `SchedulerBlocks` preempts; a step that
preempted admits nobody new. A pure decode step takes the fast path of
`cleave.engine.decode_plan`. The plan is a `SchedulerOutput` of `ScheduledSequence` entries;
the planner also counts the step in `SchedulerStats`.
"""

from __future__ import annotations

from cleave.engine.config import SchedulerConfig
from cleave.engine.decode_plan import plan_decodes
from cleave.engine.scheduler_blocks import SchedulerBlocks
from cleave.engine.scheduler_output import ScheduledSequence, SchedulerOutput, SchedulerStats
from cleave.engine.scheduler_queues import SequenceQueues
from cleave.engine.sequence import Sequence, SequenceStatus
from cleave.kv.manager import NO_HIT


class StepPlanner:
    """Plans one step within the token budget, the sequence limit and KV capacity."""

    def __init__(
        self, config: SchedulerConfig, queues: SequenceQueues, blocks: SchedulerBlocks, stats: SchedulerStats
    ) -> None:
        self.config = config
        self._queues = queues
        self._blocks = blocks
        self._stats = stats

    def plan(self) -> SchedulerOutput:
        """Allocate the next step's KV slots and return its plan (possibly empty)."""
        output = self._plan_decodes()
        if output is not None:
            return output
        queues = self._queues
        budget = self.config.max_num_batched_tokens
        planned: dict[str, tuple[Sequence, int]] = {}
        preempted: list[str] = []

        decodes_first = sorted(queues.running, key=lambda s: (s.num_uncomputed_tokens > 1, queues.priority_key(s)))
        for seq in decodes_first:
            if budget == 0 or len(planned) >= self.config.max_num_seqs:
                break
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted earlier in this loop
            num_new = min(seq.num_uncomputed_tokens, budget)
            victims = self._blocks.allocate_or_preempt(seq, num_new)
            for victim in victims:
                preempted.append(victim.seq_id)
                if victim.seq_id in planned:
                    budget += planned.pop(victim.seq_id)[1]
            if not victims or victims[-1] is not seq:
                planned[seq.seq_id] = (seq, num_new)
                budget -= num_new

        if not preempted:
            budget = self._admit_waiting(budget, planned)

        self._stats.num_steps += 1
        return SchedulerOutput(
            scheduled=[self._entry(seq, num_new) for seq, num_new in planned.values()],
            block_copies=self._blocks.kv.take_pending_copies(),
            preempted_seq_ids=preempted,
            finished_seq_ids=queues.take_finished(),
        )

    def _plan_decodes(self) -> SchedulerOutput | None:
        """The plan of a pure decode step, or None when the general planner is needed.

        Applies when nothing waits, no fork is pending and every running sequence fits the
        step's limits; `plan_decodes` checks the rest (see `cleave.engine.decode_plan`).
        """
        queues = self._queues
        running = queues.running
        num_running = len(running)
        config = self.config
        if (
            not running
            or queues.waiting
            or queues.pending_forks
            or num_running > config.max_num_seqs
            or num_running > config.max_num_batched_tokens
        ):
            return None
        kv = self._blocks.kv
        plan = plan_decodes(queues.running_order(), kv)
        if plan is None:
            return None
        scheduled, num_decodes = plan
        stats = self._stats
        stats.num_steps += 1
        stats.num_decode_tokens += num_decodes
        stats.num_prefill_tokens += num_running - num_decodes
        return SchedulerOutput(scheduled, kv.take_pending_copies(), [], queues.take_finished())

    def _admit_waiting(self, budget: int, planned: dict[str, tuple[Sequence, int]]) -> int:
        """Admit waiting sequences in priority order while budget, seats and blocks last."""
        queues, kv, config = self._queues, self._blocks.kv, self.config
        pending_forks = queues.pending_forks
        reserved_forks = sum(len(pending_forks.get(s.seq_id, ())) for s in queues.running)
        while queues.waiting and budget > 0 and len(planned) < config.max_num_seqs:
            seq = queues.waiting[0]
            group_size = 1 + len(pending_forks.get(seq.seq_id, ()))
            if len(queues.running) + reserved_forks + group_size > config.max_num_seqs:
                break
            # prompt logprobs need every prompt position's logits: no prefix-cache hit
            wants_prompt_logprobs = getattr(seq.sampling_params, "prompt_logprobs", None) is not None
            hit = NO_HIT if wants_prompt_logprobs else kv.get_computed_blocks(seq.seq_id, seq.all_token_ids)
            num_new = seq.num_tokens - hit.num_computed_tokens
            if num_new > budget:
                if not config.enable_chunked_prefill:
                    break
                num_new = budget
            if not kv.allocate_slots(seq.seq_id, num_new, hit):
                break
            queues.waiting.pop(0)
            seq.num_computed_tokens = hit.num_computed_tokens
            seq.num_cached_tokens = hit.num_computed_tokens
            self._stats.num_prefix_cache_hit_tokens += hit.num_computed_tokens
            if kv.enable_prefix_caching:
                self._stats.num_prefix_cache_query_tokens += seq.num_tokens
            queues.start_running(seq)
            reserved_forks += group_size - 1
            planned[seq.seq_id] = (seq, num_new)
            budget -= num_new
        return budget

    def _entry(self, seq: Sequence, num_new: int) -> ScheduledSequence:
        start = seq.num_computed_tokens
        sample = start + num_new == seq.num_tokens
        is_decode = num_new == 1 and sample and seq.num_output_tokens > 0
        if is_decode:
            self._stats.num_decode_tokens += 1
        else:
            self._stats.num_prefill_tokens += num_new
        forks = tuple(self._queues.pending_forks.get(seq.seq_id, ())) if sample else ()
        return ScheduledSequence(
            seq=seq,
            num_new_tokens=num_new,
            token_ids=seq.all_token_ids[start : start + num_new],
            start_position=start,
            sample=sample,
            block_table=self._blocks.kv.block_table_view(seq.seq_id),
            forks=forks,
            is_prefill=not is_decode,
        )
