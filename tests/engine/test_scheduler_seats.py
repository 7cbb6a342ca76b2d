"""Received sequences (`add_prefilled`, a decode worker's) take seats in the batch like any
other: at most `max_num_seqs` run; the rest wait holding their blocks, in priority order, and
take a free seat before a waiting prompt."""

from cleave.engine.sequence import SequenceStatus

from .test_scheduler import BLOCK, expected_outputs, make, next_token, seq, step, summary


def receive(scheduler, runner, request_id, prompt, max_tokens, priority=0, arrival=0.0):
    """A sequence as a decode worker gets it: prompt KV in reserved blocks, first token drawn
    elsewhere."""
    blocks = scheduler.kv.reserve(f"{request_id}/0", len(prompt))
    for position, token in enumerate(prompt):
        runner.cache[blocks[position // BLOCK]][position % BLOCK] = token
    remote = seq(request_id, prompt, max_tokens=max_tokens, priority=priority, arrival=arrival)
    remote.num_computed_tokens = len(prompt)
    remote.append_token(next_token(prompt, 0))
    scheduler.add_prefilled(remote)
    return remote


def test_received_sequences_past_the_seats_wait_holding_their_blocks_and_run_in_priority_order():
    scheduler, runner = make(max_num_seqs=2)
    a = receive(scheduler, runner, "a", [1, 2, 3], max_tokens=3, arrival=0)
    b = receive(scheduler, runner, "b", [4, 5, 6], max_tokens=5, arrival=1)
    assert scheduler.num_parked == 2 and scheduler.num_waiting == 2  # seated at the next schedule
    order = [entry.seq_id for entry in step(scheduler, runner).scheduled]
    late = receive(scheduler, runner, "late", [7, 8, 9], max_tokens=2, priority=5, arrival=2)
    urgent = receive(scheduler, runner, "urgent", [1, 1, 1], max_tokens=2, priority=-5, arrival=3)
    while scheduler.has_unfinished():
        out = step(scheduler, runner)
        assert len(out.scheduled) <= 2 and scheduler.num_running <= 2
        order.extend(entry.seq_id for entry in out.scheduled if entry.seq_id not in order)
        parked = [s for s in (late, urgent) if s.status is SequenceStatus.WAITING]
        assert all(scheduler.kv.has(s.seq_id) for s in parked)  # waiting, they keep their KV
    assert order == ["a/0", "b/0", "urgent/0", "late/0"]
    assert all(s.status is SequenceStatus.FINISHED_LENGTH for s in (a, b, late, urgent))
    assert all(s.output_token_ids == expected_outputs(s) for s in (a, b, late, urgent))
    assert scheduler.kv.num_free_blocks == 31


def test_a_full_batch_keeps_the_fast_decode_plan():
    scheduler, runner = make(max_num_seqs=1)
    receive(scheduler, runner, "a", [1, 2, 3], max_tokens=4)
    step(scheduler, runner)
    receive(scheduler, runner, "b", [4, 5, 6], max_tokens=2)
    planned = []
    plan_decodes = scheduler._plan_decodes
    scheduler._plan_decodes = lambda: planned.append(plan := plan_decodes()) or plan
    out = step(scheduler, runner)
    assert summary(out) == [("a/0", 4, 1, True)] and planned[0] is out  # b waits without a slow plan


def test_a_waiting_received_sequence_aborted_frees_its_blocks():
    scheduler, runner = make(max_num_seqs=1)
    receive(scheduler, runner, "a", [1, 2, 3], max_tokens=4)
    step(scheduler, runner)
    free = scheduler.kv.num_free_blocks
    receive(scheduler, runner, "b", list(range(1, 10)), max_tokens=2)  # 3 blocks
    assert scheduler.kv.num_free_blocks == free - 3
    assert [s.seq_id for s in scheduler.abort("b")] == ["b/0"]
    assert scheduler.kv.num_free_blocks == free and scheduler.num_parked == 0
    out = step(scheduler, runner)
    assert out.finished_seq_ids == ["b/0"] and summary(out) == [("a/0", 4, 1, True)]


def test_a_free_seat_goes_to_a_received_sequence_before_a_waiting_prompt():
    # The waiting prompt (priority -1) may need blocks the received one (priority 3) holds:
    # the received one, which needs none, runs first.
    scheduler, runner = make(max_num_seqs=1)
    holder = receive(scheduler, runner, "holder", [1, 2, 3], max_tokens=3)
    step(scheduler, runner)
    scheduler.add(seq("prompt", [5, 6, 7], max_tokens=2, priority=-1, arrival=1))
    received = receive(scheduler, runner, "received", [4, 4, 4], max_tokens=2, priority=3, arrival=2)
    out = step(scheduler, runner)
    assert holder.is_finished and summary(out) == [("holder/0", 4, 1, True)]
    assert summary(step(scheduler, runner)) == [("received/0", 3, 1, True)]
    while scheduler.has_unfinished():
        step(scheduler, runner)
    assert received.output_token_ids == expected_outputs(received)
    assert scheduler.kv.num_free_blocks == 31
