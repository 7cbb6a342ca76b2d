"""InputBatchBuilder: the pure-decode path builds exactly what the general path builds; a mixed
step's metadata counts its leading decodes."""

from __future__ import annotations

import torch

from cleave.engine.config import SchedulerConfig
from cleave.engine.input_batch import InputBatch, InputBatchBuilder
from cleave.engine.scheduler import Scheduler
from cleave.engine.sequence import Sequence, SequenceStatus
from cleave.kv.manager import KVCacheManager

BLOCK = 4


def assert_same(fast: InputBatch, general: InputBatch) -> None:
    for name in ("input_ids", "positions"):
        assert torch.equal(getattr(fast, name), getattr(general, name)), name
    for name in ("slot_mapping", "query_start_loc", "seq_lens", "block_tables"):
        a, b = getattr(fast.metadata, name), getattr(general.metadata, name)
        assert a.dtype == b.dtype and torch.equal(a, b), name
    assert fast.metadata.max_query_len == general.metadata.max_query_len == 1
    assert fast.metadata.max_seq_len == general.metadata.max_seq_len
    assert fast.metadata.num_decode_seqs == general.metadata.num_decode_seqs == fast.num_entries
    assert fast.logits_indices is None and general.logits_indices is None
    assert fast.sample_rows is None and general.sample_rows is None
    assert fast.sampled_seqs == general.sampled_seqs
    assert (fast.num_tokens, fast.num_entries) == (general.num_tokens, general.num_entries)


def decode_step_matches(scheduler: Scheduler, builder: InputBatchBuilder, reference: InputBatchBuilder,
                        step: int) -> bool:
    """Schedule, build and run one step (token ids made up); a pure-decode step's batch must
    equal the general path's. Returns whether the step was pure decode."""
    output = scheduler.schedule()
    batch = builder.build(output)
    fast = all(entry.num_new_tokens == 1 for entry in output.scheduled)
    if fast:
        assert_same(batch, reference.build_general(output))
    scheduler.advance(output)
    scheduler.resolve(output, [20 + step + row for row in range(len(output.sampled_seqs))])
    return fast


def test_decode_steps_match_general_path_across_blocks_and_membership_changes():
    kv = KVCacheManager(64, BLOCK)
    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8, max_model_len=64), kv)
    for index, prompt_len in enumerate((3, 5, 9)):
        scheduler.add(Sequence(f"r{index}", list(range(10, 10 + prompt_len))))
    builder, reference = InputBatchBuilder(BLOCK, torch.device("cpu")), InputBatchBuilder(BLOCK, torch.device("cpu"))
    num_fast = num_mixed = 0
    for step in range(14):
        output = scheduler.schedule()
        batch = builder.build(output)
        general = reference.build_general(output)
        if all(entry.num_new_tokens == 1 for entry in output.scheduled):
            assert_same(batch, general)
            num_fast += 1
        else:  # the decodes lead, and the metadata counts them for the decode kernel
            decodes = [not entry.is_prefill for entry in output.scheduled]
            assert decodes == sorted(decodes, reverse=True)
            assert batch.metadata.num_decode_seqs == decodes.count(True)
            num_mixed += 0 < decodes.count(True) < len(decodes)
        tokens = [20 + step + row for row in range(len(output.sampled_seqs))]
        scheduler.advance(output)
        scheduler.resolve(output, tokens)
        if step == 6:
            scheduler.finish("r1/0", SequenceStatus.FINISHED_STOPPED)
        if step == 9:
            scheduler.add(Sequence("r3", [1, 2, 3, 4, 5, 6]))
    assert num_fast >= 10 and num_mixed >= 1
    assert [len(kv.block_table(seq.seq_id)) for seq in scheduler.running] == [4, 6, 3]


def test_decode_tables_follow_blocks_dropped_behind_a_sliding_window():
    """Drops never fall on a step that grows a table (window 6, blocks of 4): the kept
    device tables must still show the null block where the manager dropped one."""
    kv = KVCacheManager(64, BLOCK, sliding_window=6)
    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8, max_model_len=64), kv)
    for index, prompt_len in enumerate((3, 6)):
        scheduler.add(Sequence(f"r{index}", list(range(10, 10 + prompt_len))))
    builder, reference = InputBatchBuilder(BLOCK, torch.device("cpu")), InputBatchBuilder(BLOCK, torch.device("cpu"))
    num_fast = 0
    for step in range(20):
        num_fast += decode_step_matches(scheduler, builder, reference, step)
    assert num_fast == 19
    # r1 has KV for 25 tokens; the next query (position 25) sees 20..25: blocks 0..4 are dropped.
    table = kv.block_table("r1/0")
    assert len(table) == 7 and table[:5] == [0] * 5 and 0 not in table[5:]


def test_decode_tables_of_a_churning_batch_match_a_fresh_build(monkeypatch):
    """Sequences finish, join (after their prompt step) and grow blocks at random: every pure
    decode step's tables equal the general path's, and most changed batches are regathered
    from the kept rows rather than written whole (fails if a kept row, a joining row's
    padding or a grown block is left stale)."""
    import random

    rng = random.Random(3)
    kv = KVCacheManager(1024, BLOCK)
    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=256, max_num_seqs=16, max_model_len=256), kv)
    regathered = []
    original = InputBatchBuilder._regathered

    def spy(self, *args):
        result = original(self, *args)
        regathered.append(result is not None)
        return result

    monkeypatch.setattr(InputBatchBuilder, "_regathered", spy)
    builder, reference = InputBatchBuilder(BLOCK, torch.device("cpu")), InputBatchBuilder(BLOCK, torch.device("cpu"))
    next_id = 0
    for _ in range(12):
        scheduler.add(Sequence(f"r{next_id}", list(range(10, 10 + rng.randrange(1, 30)))))
        next_id += 1
    num_fast = 0
    for step in range(80):
        if not scheduler.running and not scheduler.waiting:
            break
        num_fast += decode_step_matches(scheduler, builder, reference, step)
        running = [seq for seq in scheduler.running if seq.status is SequenceStatus.RUNNING]
        for seq in rng.sample(running, min(len(running), rng.choice((0, 0, 0, 1, 2)))):
            scheduler.finish(seq.seq_id, SequenceStatus.FINISHED_STOPPED)
        if step % 3 == 0:
            for _ in range(rng.choice((1, 2))):
                scheduler.add(Sequence(f"r{next_id}", list(range(10, 10 + rng.randrange(1, 30)))))
                next_id += 1
    assert num_fast >= 40
    assert regathered.count(True) >= 20


def test_every_column_of_a_batch_starts_16_byte_aligned():
    """Odd batch sizes and token counts: the int64 columns cut from one device buffer start
    at 16-byte offsets from it (a kernel handed a misaligned view compiles a variant of its
    own mid-run; fails without the padding between columns)."""
    kv = KVCacheManager(64, BLOCK)
    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8, max_model_len=64), kv)
    for index, prompt_len in enumerate((3, 6, 2)):
        scheduler.add(Sequence(f"r{index}", list(range(10, 10 + prompt_len))))
    builder = InputBatchBuilder(BLOCK, torch.device("cpu"))
    kinds = set()
    for step in range(3):
        output = scheduler.schedule()
        batch = builder.build(output)
        base = batch.input_ids.data_ptr()
        columns = [batch.positions, batch.metadata.slot_mapping, batch.metadata.seq_lens]
        columns += [t for t in (batch.logits_indices, batch.sample_rows) if t is not None]
        for column in columns:
            assert (column.data_ptr() - base) % 16 == 0
        kinds.add("decode" if batch.metadata.is_decode_only else "mixed")
        scheduler.advance(output)
        scheduler.resolve(output, [20 + row for row in range(len(output.sampled_seqs))])
    assert kinds == {"decode", "mixed"}


def test_every_batch_shares_one_zeroed_set_of_split_counters():
    """Decode and mixed batches alike carry the builder's split counters (the attention kernels
    count in them and leave them zeroed), so no attention layer zeroes counters of its own; a
    batch of more entries than they were sized for gets larger ones."""
    from cleave.kv.metadata import MAX_KV_HEADS

    kv = KVCacheManager(64, BLOCK)
    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=16, max_model_len=64), kv)
    for index, prompt_len in enumerate((3, 5, 9)):
        scheduler.add(Sequence(f"r{index}", list(range(10, 10 + prompt_len))))
    builder = InputBatchBuilder(BLOCK, torch.device("cpu"))
    seen = []
    for step in range(4):
        output = scheduler.schedule()
        batch = builder.build(output)
        seen.append(batch.metadata.split_counters)
        scheduler.advance(output)
        scheduler.resolve(output, [20 + step + row for row in range(len(output.sampled_seqs))])
    assert all(counters is seen[0] for counters in seen) and not seen[0].any()
    assert seen[0].numel() >= 3 * MAX_KV_HEADS
    for index in range(3, 12):  # a batch too large for them
        scheduler.add(Sequence(f"r{index}", [1, 2]))
    output = scheduler.schedule()
    larger = builder.build(output).metadata.split_counters
    assert len(output.scheduled) * MAX_KV_HEADS > seen[0].numel()
    assert larger.numel() >= len(output.scheduled) * MAX_KV_HEADS and not larger.any()
