"""The scheduler's limits at their edges: a budget filled exactly, a seat count reached, a
threshold passed by one token, a preemption's step, and the prefix-cache index of a block a
decode fills, on the scheduler test's paged fake model."""

from __future__ import annotations

from cleave.engine.config import SchedulerConfig
from cleave.engine.scheduler import Scheduler
from cleave.engine.sequence import SequenceStatus
from cleave.kv.manager import KVCacheManager

from .test_scheduler import BLOCK, FakeRunner, expected_outputs, make, next_token, seq, step, summary


def add_prefilled(scheduler, runner, request_id, prompt, max_tokens):
    """Admit a sequence as a decode worker does: its prompt's KV written into reserved blocks
    and its first token sampled elsewhere."""
    blocks = scheduler.kv.reserve(f"{request_id}/0", len(prompt))
    for position, token in enumerate(prompt):
        runner.cache[blocks[position // BLOCK]][position % BLOCK] = token
    remote = seq(request_id, prompt, max_tokens=max_tokens)
    remote.num_computed_tokens = len(prompt)
    remote.append_token(next_token(prompt, 0))
    scheduler.add_prefilled(remote)
    return remote


def test_a_step_that_preempts_admits_nobody_new():
    # 4 usable blocks; two 6-token prompts fill them by their third decode, and a third
    # request waits for a seat (max_num_seqs 2) that the preemption frees.
    scheduler, runner = make(num_blocks=5, budget=16, max_num_seqs=2, max_model_len=16)
    a = seq("a", [1, 2, 3, 4, 5, 6], max_tokens=5, arrival=0)
    b = seq("b", [9, 8, 7, 6, 5, 4], max_tokens=6, arrival=1)
    scheduler.add(a)
    scheduler.add(b)
    step(scheduler, runner)
    scheduler.add(seq("c", [7], max_tokens=2, priority=-1, arrival=2))  # first in line, one block
    preempting_steps = 0
    while scheduler.has_unfinished():
        running_before = {s.seq_id for s in scheduler.running}
        out = step(scheduler, runner)
        if out.preempted_seq_ids:
            preempting_steps += 1
            assert {entry.seq_id for entry in out.scheduled} <= running_before
    assert preempting_steps > 0
    assert scheduler.kv.num_free_blocks == 4


def test_a_block_filled_by_a_decode_is_indexed_in_that_step():
    scheduler, runner = make()
    a = seq("a", [1, 2, 3], max_tokens=6, arrival=0)  # its last decode fills its second block
    scheduler.add(a)
    while scheduler.has_unfinished():
        step(scheduler, runner)
    assert a.status is SequenceStatus.FINISHED_LENGTH and a.num_tokens == 9
    b = seq("b", a.all_token_ids, max_tokens=1, arrival=1)
    scheduler.add(b)
    out = step(scheduler, runner)
    assert summary(out) == [("b/0", 8, 1, True)]
    assert b.num_cached_tokens == 8
    assert b.output_token_ids == expected_outputs(b)


def test_seats_for_the_forks_of_an_admitted_group_are_reserved():
    scheduler, runner = make(max_num_seqs=4)
    first = [seq("g", [1, 2, 3], max_tokens=3, index=i, arrival=0) for i in range(3)]
    second = [seq("h", [4, 5, 6], max_tokens=3, index=i, arrival=1) for i in range(2)]
    scheduler.add_group(first)
    scheduler.add_group(second)
    out = step(scheduler, runner)
    assert summary(out) == [("g/0", 0, 3, True)]  # h/0 and its fork would make five
    while scheduler.has_unfinished():
        out = step(scheduler, runner)
        assert len(scheduler.running) <= 4 and len(out.scheduled) <= 4
    assert all(s.output_token_ids == expected_outputs(s) for s in [*first, *second])


def test_without_chunked_prefill_a_prompt_that_exactly_fills_the_budget_runs_this_step():
    kv = KVCacheManager(32, BLOCK, enable_prefix_caching=True)
    config = SchedulerConfig(max_num_batched_tokens=8, max_num_seqs=8, max_model_len=8, enable_chunked_prefill=False)
    scheduler, runner = Scheduler(config, kv), FakeRunner(32)
    a = seq("a", [1, 2], max_tokens=4, arrival=0)
    scheduler.add(a)
    assert summary(step(scheduler, runner)) == [("a/0", 0, 2, True)]
    b = seq("b", list(range(10, 17)), max_tokens=1, arrival=1)  # 7 tokens: the budget after a's decode
    scheduler.add(b)
    assert summary(step(scheduler, runner)) == [("a/0", 2, 1, True), ("b/0", 0, 7, True)]
    assert b.output_token_ids == expected_outputs(b)


def test_the_long_prefill_threshold_caps_a_prompt_one_token_over_it():
    scheduler, runner = make(budget=6, long_prefill=4)
    scheduler.add(seq("a", [1, 2, 3, 4, 5], max_tokens=2, arrival=0))  # threshold + 1 tokens
    scheduler.add(seq("b", [7, 8], max_tokens=2, arrival=1))
    assert summary(step(scheduler, runner)) == [("a/0", 0, 4, False), ("b/0", 0, 2, True)]


def test_pure_decode_steps_respect_a_token_budget_below_the_running_count():
    scheduler, runner = make(budget=2, max_num_seqs=4)
    seqs = [add_prefilled(scheduler, runner, name, [index + 1] * 3, max_tokens=3) for index, name in enumerate("abc")]
    out = step(scheduler, runner)
    assert summary(out) == [("a/0", 3, 1, True), ("b/0", 3, 1, True)]
    while scheduler.has_unfinished():
        assert step(scheduler, runner).num_batched_tokens <= 2
    assert all(s.output_token_ids == expected_outputs(s) for s in seqs)


def test_a_sequence_preempted_after_its_step_launched_keeps_its_sampled_token():
    # 3 usable blocks, all taken by the prefills: a's first decode needs a block, so the
    # second plan, made before the first step's tokens are known, preempts b.
    scheduler, _ = make(num_blocks=4, budget=16, max_model_len=12)
    a = seq("a", [1, 2, 3, 4], max_tokens=8, arrival=0)
    b = seq("b", list(range(11, 19)), max_tokens=8, arrival=1)
    scheduler.add(a)
    scheduler.add(b)
    first = scheduler.schedule()
    assert [entry.seq_id for entry in first.scheduled] == ["a/0", "b/0"]
    scheduler.advance(first)
    second = scheduler.schedule()
    assert second.preempted_seq_ids == ["b/0"] and [entry.seq_id for entry in second.scheduled] == ["a/0"]
    scheduler.advance(second)
    assert scheduler.resolve(first, [40, 41]) == [a, b]
    assert b.status is SequenceStatus.PREEMPTED and b.num_computed_tokens == 0
    assert b.all_token_ids == [*range(11, 19), 41]  # recomputed with its real token on readmission


def test_prefilled_sequences_beyond_max_num_seqs_wait_for_a_seat():
    scheduler, runner = make(max_num_seqs=2)
    seqs = [add_prefilled(scheduler, runner, name, [index + 1] * 3, max_tokens=2) for index, name in enumerate("abc")]
    out = step(scheduler, runner)
    assert summary(out) == [("a/0", 3, 1, True), ("b/0", 3, 1, True)]
    while scheduler.has_unfinished():
        assert len(step(scheduler, runner).scheduled) <= 2
    assert all(s.output_token_ids == expected_outputs(s) for s in seqs)
