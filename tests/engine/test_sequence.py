import pytest

from cleave.engine.sequence import Sequence, SequenceStatus


def test_token_bookkeeping():
    seq = Sequence("req", [5, 6, 7], sample_index=2, priority=1, arrival_time=3.0)
    assert seq.seq_id == "req/2"
    seq.append_token(9)
    seq.num_computed_tokens = 3
    assert seq.prompt_token_ids == [5, 6, 7]
    assert seq.output_token_ids == [9]
    assert (seq.num_tokens, seq.num_output_tokens, seq.num_uncomputed_tokens) == (4, 1, 1)
    assert seq.last_token_id == 9
    assert seq.status is SequenceStatus.WAITING and not seq.is_finished


def test_finished_statuses():
    assert {s for s in SequenceStatus if s.is_finished} == {
        SequenceStatus.FINISHED_STOPPED,
        SequenceStatus.FINISHED_LENGTH,
        SequenceStatus.FINISHED_ABORTED,
    }


def test_fork_copies_tokens_and_progress_but_not_the_list():
    seq = Sequence("req", [1, 2], sampling_params="params", arrival_time=1.0)
    seq.append_token(3)
    seq.num_computed_tokens = 2
    child = seq.fork(sample_index=1)
    child.append_token(4)
    assert child.seq_id == "req/1" and child.parent_seq_id == "req/0"
    assert child.prompt_token_ids == [1, 2] and child.output_token_ids == [3, 4]
    assert seq.output_token_ids == [3]
    assert child.num_computed_tokens == 2 and child.sampling_params == "params"
    assert child.arrival_time == 1.0


def test_empty_prompt_is_rejected():
    with pytest.raises(ValueError, match="empty prompt"):
        Sequence("req", [])
