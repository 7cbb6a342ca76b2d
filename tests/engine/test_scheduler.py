import random
from dataclasses import dataclass

import pytest

from cleave.engine.config import SchedulerConfig
from cleave.engine.scheduler import Scheduler, SchedulerOutput
from cleave.engine.sequence import Sequence, SequenceStatus
from cleave.errors import InvalidArgument
from cleave.kv.manager import KVCacheManager

BLOCK = 4
EOS = 100


@dataclass(frozen=True)
class Params:
    max_tokens: int


def next_token(context, sample_index):
    """A deterministic stand-in for a model: the next token depends on the whole context."""
    return 100 + (31 * context[-1] + 7 * len(context) + 13 * sample_index + sum(context[-4:])) % 50


def stop_checker(seq, token):
    if token == EOS:
        return SequenceStatus.FINISHED_STOPPED
    if seq.num_output_tokens >= seq.sampling_params.max_tokens:
        return SequenceStatus.FINISHED_LENGTH
    return None


def expected_outputs(seq):
    """Outputs the model would produce for this prompt and sample index, step by step."""
    tokens = seq.prompt_token_ids
    outputs = []
    for _ in range(seq.num_output_tokens):
        outputs.append(next_token(tokens + outputs, seq.sample_index))
    return outputs


class FakeRunner:
    """Writes fed tokens into a paged 'KV cache' and samples from what it reads back,
    so wrong block tables, positions, copies or prefix hits change the output."""

    def __init__(self, num_blocks):
        self.cache = [[None] * BLOCK for _ in range(num_blocks)]

    def execute(self, output: SchedulerOutput):
        for src, dst in output.block_copies:
            self.cache[dst] = list(self.cache[src])
        for entry in output.scheduled:
            for offset, token in enumerate(entry.token_ids):
                position = entry.start_position + offset
                block_id = entry.block_table[position // BLOCK]
                assert block_id != 0
                self.cache[block_id][position % BLOCK] = token
        sampled = []
        for entry in output.scheduled:
            if not entry.sample:
                continue
            context = [self.cache[entry.block_table[p // BLOCK]][p % BLOCK] for p in range(entry.seq_len)]
            assert context == entry.seq.all_token_ids[: entry.seq_len], entry.seq_id
            sampled.extend(next_token(context, seq.sample_index) for seq in entry.sample_seqs)
        return sampled


def make(num_blocks=32, budget=64, max_num_seqs=8, max_model_len=64, prefix_caching=True, long_prefill=0):
    kv = KVCacheManager(num_blocks, BLOCK, enable_prefix_caching=prefix_caching)
    config = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_num_seqs, max_model_len=max_model_len,
                             long_prefill_token_threshold=long_prefill)
    return Scheduler(config, kv), FakeRunner(num_blocks)


def seq(request_id, prompt, max_tokens=4, priority=0, arrival=0.0, index=0):
    return Sequence(request_id, prompt, sample_index=index, sampling_params=Params(max_tokens), priority=priority, arrival_time=arrival)


def record(scheduler, output, tokens, checker=stop_checker):
    """A synchronous step's tokens back into the scheduler: advance, then resolve at once."""
    scheduler.advance(output)
    return scheduler.resolve(output, tokens, checker)


def step(scheduler, runner):
    output = scheduler.schedule()
    record(scheduler, output, runner.execute(output))
    return output


def summary(output):
    return [(e.seq_id, e.start_position, e.num_new_tokens, e.sample) for e in output.scheduled]


def test_chunked_prefill_splits_a_prompt_across_steps():
    scheduler, runner = make(budget=8)
    a = seq("a", list(range(1, 21)), max_tokens=2)
    scheduler.add(a)
    first = step(scheduler, runner)
    assert summary(first) == [("a/0", 0, 8, False)]
    assert first.scheduled[0].token_ids == list(range(1, 9))
    assert list(first.scheduled[0].block_table) == [1, 2]
    assert a.num_computed_tokens == 8 and a.num_output_tokens == 0
    assert summary(step(scheduler, runner)) == [("a/0", 8, 8, False)]
    third = step(scheduler, runner)
    assert summary(third) == [("a/0", 16, 4, True)]
    assert list(third.scheduled[0].block_table) == [1, 2, 3, 4, 5]
    assert summary(step(scheduler, runner)) == [("a/0", 20, 1, True)]
    assert a.status is SequenceStatus.FINISHED_LENGTH
    assert a.output_token_ids == expected_outputs(a)
    assert scheduler.stats.num_prefill_tokens == 20 and scheduler.stats.num_decode_tokens == 1
    assert scheduler.kv.num_free_blocks == 31


def test_partial_prefill_continues_before_new_arrivals_and_decodes_go_first():
    scheduler, runner = make(budget=10)
    a = seq("a", list(range(1, 4)), max_tokens=10, arrival=0)
    scheduler.add(a)
    assert summary(step(scheduler, runner)) == [("a/0", 0, 3, True)]
    b = seq("b", list(range(10, 25)), arrival=1)  # 15 tokens
    scheduler.add(b)
    assert summary(step(scheduler, runner)) == [("a/0", 3, 1, True), ("b/0", 0, 9, False)]
    c = seq("c", [7, 7, 7], arrival=2)
    scheduler.add(c)
    assert summary(step(scheduler, runner)) == [("a/0", 4, 1, True), ("b/0", 9, 6, True), ("c/0", 0, 3, True)]
    assert summary(step(scheduler, runner)) == [("a/0", 5, 1, True), ("b/0", 15, 1, True), ("c/0", 3, 1, True)]


def test_a_long_prompt_makes_room_for_shorter_ones_and_takes_the_rest_back():
    scheduler, runner = make(budget=10, long_prefill=4, max_model_len=48)
    a = seq("a", list(range(1, 31)), max_tokens=2, arrival=0)  # 30 tokens: long
    scheduler.add(a)
    assert summary(step(scheduler, runner)) == [("a/0", 0, 10, False)]  # alone: the whole budget
    b = seq("b", [5, 6, 7], max_tokens=2, arrival=1)
    c = seq("c", list(range(40, 49)), max_tokens=2, arrival=2)  # 9 tokens: long too
    scheduler.add(b)
    scheduler.add(c)
    # a is held to 4, b (short) gets in whole, c is held to its 3 left-over tokens; nothing left to give back
    assert summary(step(scheduler, runner)) == [("a/0", 10, 4, False), ("b/0", 0, 3, True), ("c/0", 0, 3, False)]
    # b decodes first; a and c held to 4 each, then a takes back the last token of the budget
    assert summary(step(scheduler, runner)) == [("b/0", 3, 1, True), ("a/0", 14, 5, False), ("c/0", 3, 4, False)]
    while scheduler.has_unfinished():
        step(scheduler, runner)
    for s in (a, b, c):
        assert s.status is SequenceStatus.FINISHED_LENGTH and s.output_token_ids == expected_outputs(s)
    assert scheduler.kv.num_free_blocks == 31


def test_the_long_prefill_threshold_must_not_be_negative():
    with pytest.raises(ValueError, match="long_prefill_token_threshold"):
        SchedulerConfig(long_prefill_token_threshold=-1)


def test_continuous_batching_join_and_leave():
    scheduler, runner = make()
    a = seq("a", [1, 2, 3], max_tokens=2, arrival=0)
    scheduler.add(a)
    step(scheduler, runner)
    b = seq("b", [4, 5, 6, 7, 8], max_tokens=3, arrival=1)
    scheduler.add(b)
    assert summary(step(scheduler, runner)) == [("a/0", 3, 1, True), ("b/0", 0, 5, True)]
    assert a.status is SequenceStatus.FINISHED_LENGTH
    out = step(scheduler, runner)
    assert summary(out) == [("b/0", 5, 1, True)] and out.finished_seq_ids == ["a/0"]
    step(scheduler, runner)
    assert b.is_finished and not scheduler.has_unfinished()
    assert [a.output_token_ids, b.output_token_ids] == [expected_outputs(a), expected_outputs(b)]
    assert scheduler.kv.num_free_blocks == 31


def test_priority_then_fcfs_admission():
    scheduler, runner = make(max_num_seqs=1)
    for request_id, priority, arrival in [("a", 1, 0), ("b", 0, 1), ("c", 0, 2), ("d", 1, 3)]:
        scheduler.add(seq(request_id, [1, 2], max_tokens=1, priority=priority, arrival=arrival))
    order = [step(scheduler, runner).scheduled[0].seq_id for _ in range(4)]
    assert order == ["b/0", "c/0", "a/0", "d/0"]


def test_prefix_cache_hit_skips_computed_tokens():
    scheduler, runner = make()
    prompt = list(range(1, 11))
    first = seq("a", prompt, max_tokens=1, arrival=0)
    scheduler.add(first)
    step(scheduler, runner)
    second = seq("b", prompt + [50], max_tokens=1, arrival=1)
    scheduler.add(second)
    out = step(scheduler, runner)
    assert summary(out) == [("b/0", 8, 3, True)]
    assert list(out.scheduled[0].block_table) == [1, 2, 4]
    assert second.num_cached_tokens == 8 and scheduler.stats.num_prefix_cache_hit_tokens == 8
    assert second.output_token_ids == expected_outputs(second)


def test_preemption_by_recompute_under_a_tiny_pool():
    # 4 usable blocks of 4 tokens; two 6-token prompts fill 4 blocks after prefill.
    scheduler, runner = make(num_blocks=5, budget=16, max_model_len=16)
    a = seq("a", [1, 2, 3, 4, 5, 6], max_tokens=5, arrival=0)
    b = seq("b", [9, 8, 7, 6, 5, 4], max_tokens=6, arrival=1)
    scheduler.add(a)
    scheduler.add(b)
    for _ in range(3):
        step(scheduler, runner)
    assert (a.num_tokens, b.num_tokens) == (9, 9)
    out = step(scheduler, runner)  # a needs a third block: b (later arrival) is preempted
    assert out.preempted_seq_ids == ["b/0"] and summary(out) == [("a/0", 8, 1, True)]
    assert list(out.scheduled[0].block_table) == [1, 2, 4]
    assert b.status is SequenceStatus.PREEMPTED and b.num_computed_tokens == 0 and b.num_preemptions == 1
    assert scheduler.kv.block_table("b/0") == []
    out = step(scheduler, runner)  # b's prefix block 3 is cached but 2 more blocks are not free
    assert summary(out) == [("a/0", 9, 1, True)]
    assert a.is_finished and a.output_token_ids == expected_outputs(a)
    out = step(scheduler, runner)  # recompute b's prompt and outputs after its cached first block
    assert summary(out) == [("b/0", 4, 5, True)]
    assert out.scheduled[0].token_ids == b.all_token_ids[4:9]
    assert list(out.scheduled[0].block_table) == [3, 4, 2]
    while scheduler.has_unfinished():
        step(scheduler, runner)
    assert b.output_token_ids == expected_outputs(b) and b.num_output_tokens == 6
    assert scheduler.kv.num_free_blocks == 4


def test_preemption_prefers_lower_priority_over_later_arrival():
    scheduler, runner = make(num_blocks=5, budget=16, max_model_len=16)
    low = seq("low", [1, 2, 3, 4, 5, 6], max_tokens=8, priority=1, arrival=0)
    high = seq("high", [9, 8, 7, 6, 5, 4], max_tokens=4, priority=0, arrival=1)
    scheduler.add(low)
    scheduler.add(high)
    preempted = []
    while high.status is not SequenceStatus.FINISHED_LENGTH:
        preempted += step(scheduler, runner).preempted_seq_ids
    assert preempted == ["low/0"]
    while scheduler.has_unfinished():
        step(scheduler, runner)
    assert low.output_token_ids == expected_outputs(low) and high.output_token_ids == expected_outputs(high)


def test_abort_frees_waiting_running_and_in_flight_sequences():
    scheduler, runner = make(budget=8)
    a = seq("a", list(range(1, 13)), arrival=0)
    b = seq("b", [5, 6, 7], arrival=1)
    scheduler.add(a)
    scheduler.add(b)
    out = scheduler.schedule()
    assert summary(out) == [("a/0", 0, 8, False)]
    assert scheduler.abort("a") == [a]  # while the step runs
    assert record(scheduler, out, runner.execute(out)) == []
    assert a.status is SequenceStatus.FINISHED_ABORTED
    assert scheduler.kv.num_free_blocks == 31
    out = step(scheduler, runner)
    assert out.finished_seq_ids == ["a/0"] and summary(out) == [("b/0", 0, 3, True)]
    assert scheduler.abort("b") == [b] and scheduler.abort("b") == []
    assert scheduler.kv.num_free_blocks == 31 and not scheduler.has_unfinished()


def test_parallel_samples_share_one_prefill_and_copy_on_write():
    scheduler, runner = make(num_blocks=16, max_num_seqs=8, max_model_len=40)
    prompt = list(range(1, 11))  # 2 full blocks + 2 tokens in block 3
    group = [seq("r", prompt, max_tokens=3, index=i) for i in range(8)]
    scheduler.add_group(group)
    out = step(scheduler, runner)
    assert summary(out) == [("r/0", 0, 10, True)]
    assert [s.seq_id for s in out.sampled_seqs] == [f"r/{i}" for i in range(8)]
    assert all(s.status is SequenceStatus.RUNNING for s in group)
    assert all(scheduler.kv.block_table(s.seq_id) == [1, 2, 3] for s in group)
    assert [scheduler.kv.pool.ref_count(b) for b in (1, 2, 3)] == [8, 8, 8]
    out = step(scheduler, runner)
    assert out.block_copies == [(3, 4), (3, 5), (3, 6), (3, 7), (3, 8), (3, 9), (3, 10)]
    assert [list(e.block_table) for e in out.scheduled] == [[1, 2, b] for b in (4, 5, 6, 7, 8, 9, 10, 3)]
    while scheduler.has_unfinished():
        step(scheduler, runner)
    assert scheduler.stats.num_prefill_tokens == 10
    assert all(s.output_token_ids == expected_outputs(s) and s.num_output_tokens == 3 for s in group)
    assert len({tuple(s.output_token_ids) for s in group}) == 8
    assert scheduler.kv.num_free_blocks == 15


def test_finishing_a_group_leader_before_its_prefill_promotes_the_next_sample():
    scheduler, runner = make(budget=4)
    group = [seq("r", list(range(1, 7)), max_tokens=2, index=i) for i in range(3)]
    scheduler.add_group(group)
    assert summary(step(scheduler, runner)) == [("r/0", 0, 4, False)]
    scheduler.finish("r/0", SequenceStatus.FINISHED_ABORTED)
    out = step(scheduler, runner)
    assert out.finished_seq_ids == ["r/0"]
    assert summary(out) == [("r/1", 4, 2, True)]  # the cached first block is reused
    assert [s.seq_id for s in out.sampled_seqs] == ["r/1", "r/2"]
    while scheduler.has_unfinished():
        step(scheduler, runner)
    assert all(s.output_token_ids == expected_outputs(s) for s in group[1:])
    assert scheduler.kv.num_free_blocks == 31


def test_disaggregated_decode_admits_reserved_kv():
    scheduler, runner = make()
    prompt = [3, 1, 4, 1, 5, 9]
    blocks = scheduler.kv.reserve("r/0", len(prompt))
    assert blocks == [1, 2]
    for position, token in enumerate(prompt):  # the transport fills the reserved blocks
        runner.cache[blocks[position // BLOCK]][position % BLOCK] = token
    remote = seq("r", prompt, max_tokens=2)
    remote.num_computed_tokens = len(prompt)
    remote.append_token(next_token(prompt, 0))
    scheduler.add_prefilled(remote)
    out = step(scheduler, runner)
    assert summary(out) == [("r/0", 6, 1, True)] and out.scheduled[0].token_ids == [remote.output_token_ids[0]]
    assert remote.is_finished and remote.output_token_ids == expected_outputs(remote)


def test_rejections_and_protocol_errors():
    with pytest.raises(ValueError, match="lower max_model_len"):
        make(num_blocks=4, max_model_len=16)
    scheduler, runner = make(max_model_len=8)
    with pytest.raises(InvalidArgument, match="max_model_len is 8"):
        scheduler.add(seq("long", list(range(8))))
    scheduler.add(seq("a", [1, 2]))
    with pytest.raises(ValueError, match="already added"):
        scheduler.add(seq("a", [1, 2]))
    out = scheduler.schedule()
    with pytest.raises(RuntimeError, match="advance"):
        scheduler.schedule()
    with pytest.raises(ValueError, match="1 sampled sequences"):
        record(scheduler, out, [1, 2])


def test_sequences_stop_at_max_model_len():
    scheduler, runner = make(max_model_len=8)
    a = seq("a", [1, 2, 3, 4, 5], max_tokens=100)
    scheduler.add(a)
    while scheduler.has_unfinished():
        step(scheduler, runner)
    assert a.status is SequenceStatus.FINISHED_LENGTH and a.num_tokens == 8


@pytest.mark.parametrize("long_prefill", [0, 5])
def test_no_block_leaks_under_random_load(long_prefill):
    rng = random.Random(1234)
    num_blocks = 16
    scheduler, runner = make(num_blocks=num_blocks, budget=12, max_num_seqs=6, max_model_len=40, long_prefill=long_prefill)
    shared_prefixes = [[rng.randrange(1, 90) for _ in range(rng.randrange(4, 12))] for _ in range(3)]
    all_seqs, preemptions, next_id = [], 0, 0
    for _ in range(400):
        if rng.random() < 0.3:
            prompt = rng.choice(shared_prefixes) + [rng.randrange(1, 90) for _ in range(rng.randrange(1, 10))]
            n = rng.choice([1, 1, 2, 4])
            group = [
                seq(f"q{next_id}", prompt, max_tokens=rng.randrange(1, 14), priority=rng.randrange(2), arrival=next_id, index=i)
                for i in range(n)
            ]
            scheduler.add_group(group)
            all_seqs += group
            next_id += 1
        if rng.random() < 0.05 and all_seqs:
            scheduler.abort(rng.choice(all_seqs).request_id)
        out = scheduler.schedule()
        assert out.num_batched_tokens <= 12 and len(out.scheduled) <= 6
        preemptions += len(out.preempted_seq_ids)
        if rng.random() < 0.03 and out.scheduled:
            scheduler.abort(rng.choice(out.scheduled).seq.request_id)
        record(scheduler, out, runner.execute(out))
        held = sum(len(scheduler.kv.block_table(s.seq_id)) for s in scheduler.running)
        refs = sum(scheduler.kv.pool.ref_count(b) for b in range(1, num_blocks))
        assert refs == held
    while scheduler.has_unfinished():
        step(scheduler, runner)
    assert preemptions > 20 and scheduler.stats.num_prefix_cache_hit_tokens > 0
    assert any(s.status is SequenceStatus.FINISHED_ABORTED for s in all_seqs)
    assert scheduler.kv.num_free_blocks == num_blocks - 1
    assert all(scheduler.kv.pool.ref_count(b) == 0 for b in range(1, num_blocks))
    assert scheduler.kv.take_pending_copies() == []
    for s in all_seqs:
        assert s.is_finished
        if s.status is not SequenceStatus.FINISHED_ABORTED:
            assert s.output_token_ids == expected_outputs(s)
