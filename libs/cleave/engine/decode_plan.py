"""The scheduler's fast path for a pure decode step: every running sequence feeds one token.

Most steps of a busy engine are pure decodes; `plan_decodes` builds their plan in one pass
instead of the general planner's sort, budget and preemption loop. The scheduler calls it
only when nothing waits, no fork is pending and the running sequences fit the step's limits.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

from cleave.engine.scheduler_output import ScheduledSequence
from cleave.engine.sequence import Sequence
from cleave.kv.manager import KVCacheManager


def plan_decodes(order: Seq[Sequence], kv: KVCacheManager) -> tuple[list[ScheduledSequence], int] | None:
    """Allocate one slot per sequence and plan a one-token step for each, or return None.

    Args:
        order: the running sequences in priority order (the batch order of the plan).
        kv: the cache manager holding their blocks.

    Returns:
        (entries in `order`, how many of them are decodes rather than the last prompt token
        of a recomputed prefill), or None with nothing allocated when the pool lacks a free
        block per sequence (a decode needs at most one: a new block at a boundary or a
        copy-on-write of a shared last block) or some sequence has other than exactly one
        token to feed. The plan is then exactly the general planner's, and nobody is
        preempted.
    """
    for seq in order:
        if len(seq.all_token_ids) - seq.num_computed_tokens != 1:
            return None
    if not kv.allocate_decode_slots([seq.seq_id for seq in order]):
        return None
    block_table_view = kv.block_table_view
    scheduled: list[ScheduledSequence] = []
    num_decodes = 0
    for seq in order:
        seq_id = seq.seq_id
        tokens = seq.all_token_ids
        start = len(tokens) - 1
        is_decode = start >= seq.num_prompt_tokens
        num_decodes += is_decode
        scheduled.append(
            ScheduledSequence(seq, 1, tokens[start:], start, True, block_table_view(seq_id), (), not is_decode)
        )
    return scheduled, num_decodes
