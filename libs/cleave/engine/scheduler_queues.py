"""The scheduler's queues: which sequences wait, which run, and in what order they are served.

`SequenceQueues` owns admission bookkeeping and nothing about KV blocks:

- `waiting`, kept sorted by `priority_key` = (priority, arrival time, add order), so the
  head is the next sequence to admit and preempted sequences go back in their place;
- `running`, in admission order, with a cached priority-sorted view for the decode fast path;
- `parked`, sorted like `waiting`: sequences whose prompt KV is already in the cache (received
  from a prefill worker) waiting for a seat in the batch, holding their blocks;
- `pending_forks`: per n-sample leader, the samples that will fork from its prefill;
- the unfinished sequences of each request (what `abort` ends) and their add order;
- the seq_ids that ended since the last `SchedulerOutput` (`take_finished`).

It validates new sequences and moves sequences between the queues; freeing their KV blocks
is `cleave.engine.scheduler.Scheduler`'s job, which calls both.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence as Seq

from cleave.engine.sequence import Sequence, SequenceStatus
from cleave.errors import InvalidArgument


class SequenceQueues:
    """Waiting and running sequences, fork groups and request groups of one scheduler."""

    def __init__(self, max_model_len: int) -> None:
        self.max_model_len = max_model_len
        self.waiting: list[Sequence] = []  # sorted by priority_key
        self.running: list[Sequence] = []
        self.parked: list[Sequence] = []  # sorted by priority_key; their KV is computed
        self.pending_forks: dict[str, list[Sequence]] = {}  # leader seq_id -> samples to fork
        self._requests: dict[str, list[Sequence]] = {}
        self._add_order: dict[str, int] = {}
        self._next_order = 0
        self._finished_since_output: list[str] = []
        # `running` sorted by priority_key, rebuilt after `running` changes (decode fast path).
        self._running_order: list[Sequence] | None = None

    @property
    def num_waiting(self) -> int:
        return len(self.waiting) + len(self.parked) + sum(len(forks) for forks in self.pending_forks.values())

    def has_unfinished(self) -> bool:
        return bool(self._requests)

    def is_added(self, seq_id: str) -> bool:
        return seq_id in self._add_order

    def request_seqs(self, request_id: str) -> Seq[Sequence]:
        """The unfinished sequences of a request, in add order (empty when none)."""
        return self._requests.get(request_id, ())

    def priority_key(self, seq: Sequence) -> tuple[int, float, int]:
        return (seq.priority, seq.arrival_time, self._add_order[seq.seq_id])

    def running_order(self) -> list[Sequence]:
        """`running` sorted by priority_key (cached until `running` changes)."""
        order = self._running_order
        if order is None:
            order = self._running_order = sorted(self.running, key=self.priority_key)
        return order

    # ---- adding ---------------------------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        """Queue a new sequence (status WAITING, nothing computed)."""
        self._check_new(seq)
        self.register(seq)
        self.enqueue(seq)

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
            self.register(seq)
            seq.parent_seq_id = leader.seq_id
        if rest:
            self.pending_forks[leader.seq_id] = list(rest)

    def register(self, seq: Sequence) -> None:
        """Record a sequence under its request and give it the next add order."""
        self._requests.setdefault(seq.request_id, []).append(seq)
        self._add_order[seq.seq_id] = self._next_order
        self._next_order += 1

    def _check_new(self, seq: Sequence) -> None:
        if seq.seq_id in self._add_order:
            raise ValueError(f"sequence {seq.seq_id} was already added")
        if seq.status is not SequenceStatus.WAITING or seq.num_computed_tokens:
            raise ValueError(f"{seq.seq_id} must be new (WAITING, nothing computed) to be added")
        if seq.num_tokens >= self.max_model_len:
            raise InvalidArgument(
                f"prompt has {seq.num_tokens} tokens but max_model_len is {self.max_model_len}; "
                "shorten the prompt to leave room for at least one output token",
                field="prompt",
            )

    # ---- moving between queues ------------------------------------------------------------

    def enqueue(self, seq: Sequence) -> None:
        """Put a sequence in `waiting` at its priority's place."""
        bisect.insort(self.waiting, seq, key=self.priority_key)

    def park(self, seq: Sequence) -> None:
        """Put a sequence whose KV is computed in `parked` at its priority's place."""
        bisect.insort(self.parked, seq, key=self.priority_key)

    def reserved_seats(self) -> int:
        """Seats the batch has taken: running sequences and the samples that will fork from
        running leaders."""
        pending = self.pending_forks
        return len(self.running) + (sum(len(pending.get(s.seq_id, ())) for s in self.running) if pending else 0)

    def start_running(self, seq: Sequence) -> None:
        """Mark a sequence RUNNING and append it to `running` (it left `waiting` already)."""
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)
        self._running_order = None

    def requeue(self, seq: Sequence) -> None:
        """Move a preempted running sequence back to `waiting`; it recomputes from token 0."""
        self.running.remove(seq)
        self._running_order = None
        seq.status = SequenceStatus.PREEMPTED
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        self.enqueue(seq)

    def take_forks(self, leader_seq_id: str) -> list[Sequence]:
        """Remove and return the samples waiting to fork from a leader (empty when none)."""
        return self.pending_forks.pop(leader_seq_id, [])

    def finish(self, seq: Sequence, status: SequenceStatus, promote_forks: bool) -> None:
        """Give a sequence its FINISHED_* status and drop it from every queue.

        Samples still waiting to fork from it are promoted (the first becomes the leader
        and waits to prefill) when `promote_forks`, else dropped with it.
        """
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
            self._running_order = None
        elif seq in self.waiting:
            self.waiting.remove(seq)
        elif seq in self.parked:
            self.parked.remove(seq)
        elif seq.parent_seq_id in self.pending_forks:
            pending = self.pending_forks[seq.parent_seq_id]
            pending.remove(seq)
            if not pending:
                del self.pending_forks[seq.parent_seq_id]
        seq.status = status
        self._finished_since_output.append(seq.seq_id)
        orphans = self.pending_forks.pop(seq.seq_id, [])
        if promote_forks and orphans:
            new_leader, *rest = orphans
            new_leader.parent_seq_id = None
            self.enqueue(new_leader)
            for child in rest:
                child.parent_seq_id = new_leader.seq_id
            if rest:
                self.pending_forks[new_leader.seq_id] = rest
        group = self._requests[seq.request_id]
        group.remove(seq)
        if not group:
            del self._requests[seq.request_id]
        self._add_order.pop(seq.seq_id, None)

    def take_finished(self) -> list[str]:
        """The seq_ids that ended since the previous call (for the next `SchedulerOutput`)."""
        finished, self._finished_since_output = self._finished_since_output, []
        return finished
