"""The scheduler's side of the KV cache: slots for a step, preemption, prefix indexing, release.

`SchedulerBlocks` wraps the `KVCacheManager` for the scheduler. When the pool cannot give a
running sequence its slots, it preempts the running sequence with the lowest priority
(highest number), latest arrival: its blocks are freed and it goes back to waiting with
`num_computed_tokens = 0`, to recompute its prompt *and* generated tokens on readmission.
It also tracks which sequences' full blocks are already indexed in the prefix cache up to
their computed tokens, so a decode that fills no block skips `cache_full_blocks`.
"""

from __future__ import annotations

from cleave.engine.scheduler_output import SchedulerStats
from cleave.engine.scheduler_queues import SequenceQueues
from cleave.engine.sequence import Sequence
from cleave.kv.manager import KVCacheManager


class SchedulerBlocks:
    """KV slots of the scheduled sequences, with preemption when the pool runs out."""

    def __init__(self, kv: KVCacheManager, queues: SequenceQueues, stats: SchedulerStats) -> None:
        self.kv = kv
        self._queues = queues
        self._stats = stats
        # Sequences whose full blocks were indexed up to their computed tokens by the previous
        # record of a step: a decode that does not complete a block has nothing new to index.
        self.indexed: set[str] = set()

    def allocate_or_preempt(self, seq: Sequence, num_new: int) -> list[Sequence]:
        """Allocate `num_new` slots for a running sequence, preempting until they fit.

        Returns the preempted sequences in order (empty when the slots fitted at once). When
        `seq` itself is preempted it is the last one, and nothing was allocated for it.
        """
        preempted: list[Sequence] = []
        queues = self._queues
        while not self.kv.allocate_slots(seq.seq_id, num_new):
            victim = max(queues.running, key=queues.priority_key)
            self.preempt(victim)
            preempted.append(victim)
            if victim is seq:
                break
        return preempted

    def preempt(self, seq: Sequence) -> None:
        """Free a running sequence's blocks and send it back to waiting."""
        self.release(seq.seq_id)
        self._queues.requeue(seq)
        self._stats.num_preemptions += 1

    def release(self, seq_id: str) -> None:
        """Drop a sequence's blocks (finished or preempted); cached full blocks stay reusable."""
        self.kv.free(seq_id)
        self.indexed.discard(seq_id)

    def index_full_blocks(self, seq: Sequence) -> None:
        """Index the sequence's blocks that are full of computed KV in the prefix cache."""
        self.kv.cache_full_blocks(seq.seq_id, seq.all_token_ids, seq.num_computed_tokens)
        self.indexed.add(seq.seq_id)
