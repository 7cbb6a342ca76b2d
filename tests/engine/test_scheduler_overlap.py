"""Overlapped scheduling (advance / resolve with stand-in tokens) against the plain loop on
the scheduler test's paged fake model: same tokens, same stops, no leaked blocks."""

from __future__ import annotations

import random

import pytest

from cleave.engine.scheduler_output import stand_in_row, stand_in_token
from cleave.engine.sequence import FINISHED_STATUSES, SequenceStatus

from .test_scheduler import EOS, FakeRunner, expected_outputs, make, record, seq

STOP_IDS = frozenset(range(EOS, EOS + 5))  # about one token in ten ends its sequence


class StandInRunner(FakeRunner):
    """The fake model, fed stand-ins as the model runner feeds them: from the tokens the
    previous launched step sampled (which the host has not recorded yet)."""

    def launch(self, output, previous_tokens):
        for entry in output.scheduled:
            entry.token_ids = [
                previous_tokens[stand_in_row(token)] if token < 0 else token for token in entry.token_ids
            ]
        saved = {}
        for entry in output.scheduled:  # the context check reads the stand-in's real token
            tokens = entry.seq.all_token_ids
            for position in range(entry.seq_len):
                if tokens[position] < 0:
                    saved[(entry.seq_id, position)] = tokens[position]
                    tokens[position] = previous_tokens[stand_in_row(tokens[position])]
        try:
            return self.execute(output)
        finally:
            for entry in output.scheduled:
                for position in range(entry.seq_len):
                    if (entry.seq_id, position) in saved:
                        entry.seq.all_token_ids[position] = saved[(entry.seq_id, position)]


def counting_checker():
    """A TokenChecker: STOP_IDS stop, max_tokens counted per sequence (stand-ins are not outputs)."""
    counts: dict[str, int] = {}

    def check(sequence, token):
        counts[sequence.seq_id] = counts.get(sequence.seq_id, 0) + 1
        if token in STOP_IDS:
            return SequenceStatus.FINISHED_STOPPED
        if counts[sequence.seq_id] >= sequence.sampling_params.max_tokens:
            return SequenceStatus.FINISHED_LENGTH
        return None

    return check


def run_overlapped(scheduler, runner, on_step=None, overlap_forks=False):
    """The overlapped loop; steps with forks are resolved at once, as the engine does,
    unless `overlap_forks` (the scheduler itself supports overlapping them)."""
    checker = counting_checker()
    previous = None  # (output, sampled tokens) launched and advanced, not yet resolved
    steps = 0
    while scheduler.has_unfinished() or previous is not None:
        output = scheduler.schedule()
        launched = None
        if not output.is_empty:
            sampled = runner.launch(output, previous[1] if previous else [])
            if output.has_forks and not overlap_forks:
                if previous is not None:
                    scheduler.resolve(*previous, checker)
                    previous = None
                record(scheduler, output, sampled, checker)
            else:
                scheduler.advance(output)
                launched = (output, sampled)
        if previous is not None:
            scheduler.resolve(*previous, checker)
        previous = launched
        steps += 1
        if on_step is not None:
            on_step(steps)
    return steps


def make_workload(seed):
    rng = random.Random(seed)
    seqs = []
    for index in range(10):
        prompt = [rng.randrange(1, 99) for _ in range(rng.randint(2, 19))]
        seqs.append(seq(f"r{index}", prompt, max_tokens=rng.randint(1, 12), priority=rng.randint(0, 1), arrival=index))
    return seqs


@pytest.mark.parametrize("num_blocks, budget", [(64, 64), (64, 7), (10, 16)])  # plain, chunked, preempting
@pytest.mark.parametrize("seed", [0, 1])
def test_overlapped_steps_produce_the_plain_loops_tokens(num_blocks, budget, seed):
    results = {}
    for overlapped in (False, True):
        scheduler, runner = make(num_blocks=num_blocks, budget=budget, max_num_seqs=6, max_model_len=32)
        runner = StandInRunner(num_blocks) if overlapped else runner
        seqs = make_workload(seed)
        for sequence in seqs:
            scheduler.add(sequence)
        if overlapped:
            run_overlapped(scheduler, runner)
        else:
            checker = counting_checker()
            while scheduler.has_unfinished():
                output = scheduler.schedule()
                record(scheduler, output, runner.execute(output), checker)
        results[overlapped] = [(s.output_token_ids, s.status) for s in seqs]
        for sequence in seqs:
            assert sequence.is_finished and min(sequence.all_token_ids) >= 0
            assert sequence.output_token_ids == expected_outputs(sequence)
        assert scheduler.kv.num_free_blocks == scheduler.kv.num_usable_blocks
        if num_blocks == 10:
            assert scheduler.stats.num_preemptions > 0
    assert results[True] == results[False]
    assert any(status is SequenceStatus.FINISHED_STOPPED for _, status in results[True])


@pytest.mark.parametrize("overlap_forks", [False, True])
def test_groups_with_forks_and_aborts_between_overlapped_steps(overlap_forks):
    scheduler, _ = make(num_blocks=64, budget=16, max_num_seqs=8)
    runner = StandInRunner(64)
    group = [seq("g", [5, 6, 7, 8, 9], max_tokens=9, index=i) for i in range(3)]
    scheduler.add_group(group)
    scheduler.add(other := seq("o", [1, 2, 3], max_tokens=30))
    scheduler.add(late := seq("l", [4, 4, 4, 4], max_tokens=6))

    def abort_other(steps):
        if steps == 5:  # a step holding o's stand-in is in flight: its token must be dropped
            assert any(t < 0 for t in other.all_token_ids)
            scheduler.abort("o")

    run_overlapped(scheduler, runner, abort_other, overlap_forks)
    for sequence in [*group, late]:
        assert sequence.output_token_ids == expected_outputs(sequence)
        assert sequence.status in FINISHED_STATUSES
    assert other.status is SequenceStatus.FINISHED_ABORTED and min(other.all_token_ids) >= 0
    assert other.output_token_ids == expected_outputs(other)
    assert scheduler.kv.num_free_blocks == scheduler.kv.num_usable_blocks


def test_a_late_stop_drops_the_next_steps_stand_in():
    scheduler, runner = make()
    a = seq("a", [1, 2, 3], max_tokens=2)
    scheduler.add(a)
    first = scheduler.schedule()  # prefill, samples token 1
    scheduler.advance(first)
    assert a.all_token_ids == [1, 2, 3, stand_in_token(0)] and a.num_computed_tokens == 3
    second = scheduler.schedule()  # decodes the stand-in, samples token 2
    assert [(e.start_position, e.token_ids) for e in second.scheduled] == [(3, [stand_in_token(0)])]
    scheduler.advance(second)
    assert scheduler.resolve(first, [EOS], counting_checker()) == [a]
    assert a.status is SequenceStatus.FINISHED_STOPPED and a.all_token_ids == [1, 2, 3, EOS]
    assert scheduler.kv.num_free_blocks == scheduler.kv.num_usable_blocks
    assert scheduler.resolve(second, [42], counting_checker()) == []
    assert a.all_token_ids == [1, 2, 3, EOS]
    with pytest.raises(ValueError, match="sampled tokens"):
        scheduler.resolve(second, [], None)


def test_forks_start_in_advance_with_stand_ins_of_their_own_rows():
    scheduler, _ = make()
    group = [seq("g", [1, 2, 3], max_tokens=3, index=i) for i in range(3)]
    scheduler.add_group(group)
    first = scheduler.schedule()
    assert [s.seq_id for s in first.sampled_seqs] == ["g/0", "g/1", "g/2"]
    scheduler.advance(first)
    assert [s.all_token_ids for s in group] == [[1, 2, 3, stand_in_token(row)] for row in range(3)]
    assert all(s.status is SequenceStatus.RUNNING and s.num_computed_tokens == 3 for s in group)
    second = scheduler.schedule()  # every sample decodes its own stand-in
    assert [e.token_ids for e in second.scheduled] == [[stand_in_token(row)] for row in range(3)]
    scheduler.advance(second)
    scheduler.abort("g")
    assert scheduler.resolve(first, [7, 8, EOS], counting_checker()) == []
    assert [s.all_token_ids for s in group] == [[1, 2, 3]] * 3
    assert scheduler.resolve(second, [9, 9, 9], counting_checker()) == []
    assert scheduler.kv.num_free_blocks == scheduler.kv.num_usable_blocks


def test_a_sequence_at_its_known_end_sits_out_until_its_token_resolves():
    """`max_num_tokens` (a prefill-only prompt: the prompt and one token): once its last token
    is sampled the sequence is planned into no step, keeps exactly its prompt's blocks, is
    never the victim when another's slots run out (its hand-off needs them), and its token
    ends it even without a checker."""
    scheduler, _ = make(num_blocks=4, budget=16, max_model_len=12)
    assert scheduler.kv.num_usable_blocks == 3
    exporting = seq("p", list(range(1, 9)), priority=1, arrival=1.0)  # two blocks, the likeliest victim
    exporting.limit_output_tokens(1)
    decoding = seq("d", [1, 2, 3, 4], max_tokens=8)  # one full block: its first decode needs another
    scheduler.add(exporting)
    scheduler.add(decoding)
    first = scheduler.schedule()
    assert [entry.seq_id for entry in first.scheduled] == ["d/0", "p/0"]
    scheduler.advance(first)
    blocks = scheduler.kv.block_table("p/0")

    second = scheduler.schedule()  # before the first step's tokens are known
    assert second.is_empty and second.preempted_seq_ids == ["d/0"]  # not "p/0"
    assert scheduler.kv.block_table("p/0") == blocks and len(blocks) == 2
    scheduler.advance(second)
    scheduler.resolve(first, [9, 7])
    assert exporting.status is SequenceStatus.FINISHED_LENGTH and exporting.output_token_ids == [7]
    assert scheduler.kv.num_free_blocks == 3  # the prompt's blocks, and the preempted decode's


def test_known_ends_launch_no_step_past_max_tokens():
    """With every sequence's max_tokens declared, the overlapped loop launches no token past
    it (without, each sequence that ends by length is launched once more and its token
    dropped), to the same outputs."""
    random.seed(5)
    prompts = [[random.randrange(1, 99) for _ in range(random.randrange(2, 12))] for _ in range(6)]

    def run(declared: bool):
        scheduler, runner = make(num_blocks=64, budget=16, max_num_seqs=4)
        seqs = [seq(f"r{i}", prompt, max_tokens=3 + i) for i, prompt in enumerate(prompts)]
        for sequence in seqs:
            if declared:
                sequence.limit_output_tokens(sequence.sampling_params.max_tokens)
            scheduler.add(sequence)
        run_overlapped(scheduler, StandInRunner(64))
        return [sequence.output_token_ids for sequence in seqs], scheduler.stats.num_decode_tokens

    (declared_outputs, declared_decodes), (outputs, decodes) = run(True), run(False)
    assert declared_outputs == outputs
    ended_by_length = sum(len(output) == 3 + i for i, output in enumerate(outputs))
    assert ended_by_length and declared_decodes == decodes - ended_by_length
