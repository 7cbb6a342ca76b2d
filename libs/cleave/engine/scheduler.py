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

`Scheduler` is the facade over one module per role: `scheduler_queues` (waiting/running
queues, admission order, fork and request groups), `scheduler_blocks` (KV slots, preemption,
prefix indexing), `scheduler_planner` (the step plan) and `scheduler_recorder` (recording a
run step, overlapped or not). The plan types live in `scheduler_output`.
"""

from __future__ import annotations

from collections.abc import Mapping
from collections.abc import Sequence as Seq

from cleave.engine.config import SchedulerConfig
from cleave.engine.scheduler_blocks import SchedulerBlocks
from cleave.engine.scheduler_output import ScheduledSequence, SchedulerOutput, SchedulerStats
from cleave.engine.scheduler_planner import StepPlanner
from cleave.engine.scheduler_queues import SequenceQueues
from cleave.engine.scheduler_recorder import StepRecorder, StopChecker, TokenChecker
from cleave.engine.sequence import Sequence, SequenceStatus
from cleave.kv.manager import KVCacheManager

__all__ = ["ScheduledSequence", "Scheduler", "SchedulerOutput", "SchedulerStats", "StopChecker", "TokenChecker"]


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
        self._queues = SequenceQueues(config.max_model_len)
        self._blocks = SchedulerBlocks(kv_manager, self._queues, self.stats)
        self._planner = StepPlanner(config, self._queues, self._blocks, self.stats)
        self._recorder = StepRecorder(config.max_model_len, self._queues, self._blocks, self._finish_promoting)

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

    def has_unfinished(self) -> bool:
        return self._queues.has_unfinished()

    def add(self, seq: Sequence) -> None:
        """Queue a new sequence (status WAITING, nothing computed)."""
        self._queues.add(seq)

    def add_group(self, seqs: Seq[Sequence]) -> None:
        """Queue n samples of one prompt: seqs[0] prefills it, the rest are forked from it."""
        self._queues.add_group(seqs)

    def add_prefilled(self, seq: Sequence) -> None:
        """Start decoding a sequence whose KV is already in the cache under `seq.seq_id`.

        For a decode worker: blocks come from `kv.reserve`, the prefill worker's KV fills
        them, `seq.num_computed_tokens` counts those tokens and the first sampled token has
        been appended (so exactly one token is left to feed).
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
        self._queues.start_running(seq)

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
                self._finish(seq, status, promote_forks=True)
                return seq
        raise KeyError(f"no unfinished sequence {seq_id!r}")

    # ---- one step -------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Plan the next step. Call `postprocess` with the result before scheduling again."""
        if self._recorder.in_flight is not None:
            raise RuntimeError("the previous SchedulerOutput was not postprocessed; call postprocess() first")
        output = self._planner.plan()
        self._recorder.expect(output)
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
        return self._recorder.postprocess(output, sampled_token_ids, stop_checker)

    def advance(self, output: SchedulerOutput) -> None:
        """Record a launched step before its tokens are known (see the module docstring).

        Every entry's tokens count as computed and each sequence that samples gets the
        stand-in `stand_in_token(row)`, row being its index in `output.sampled_seqs`;
        `schedule` may run again at once. Steps with forks share blocks in `postprocess`
        and cannot be advanced.
        """
        self._recorder.advance(output)

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
        return self._recorder.resolve(output, sampled_token_ids, token_checker)

    # ---- internals ------------------------------------------------------------------------

    def _finish(self, seq: Sequence, status: SequenceStatus, promote_forks: bool) -> None:
        self._queues.finish(seq, status, promote_forks)
        self._blocks.release(seq.seq_id)

    def _finish_promoting(self, seq: Sequence, status: SequenceStatus) -> None:
        self._finish(seq, status, promote_forks=True)
