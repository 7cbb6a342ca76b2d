"""A request's `SamplingParams.priority` in the engine: lower values are admitted first
(equal ones in arrival order), an explicit `priority` argument overrides it, a received
(handed-over) request keeps it, and an invalid one is refused naming the field."""

from __future__ import annotations

from dataclasses import replace

import pytest

from cleave.errors import InvalidArgument
from cleave.generation.sampling_params import SamplingParams
from tests.engine.test_handoff import GREEDY, PROMPT, checkpoint, make_engine  # noqa: F401 (fixture)


def first_token_order(engine) -> list[str]:  # type: ignore[no-untyped-def]
    """Step until idle; request ids in the order their first tokens came out."""
    order: list[str] = []
    while engine.has_unfinished():
        for output in engine.step():
            if output.request_id not in order and any(sample.token_ids for sample in output.outputs):
                order.append(output.request_id)
    return order


def test_one_seat_goes_to_the_lowest_priority_value_then_by_arrival(checkpoint):
    engine = make_engine(checkpoint, max_num_seqs=1)
    for request_id, priority in [("batch-1", 5), ("plain-1", 0), ("urgent", -3), ("plain-2", 0), ("batch-2", 5)]:
        engine.add_request(request_id, PROMPT, replace(GREEDY, priority=priority))
    assert first_token_order(engine) == ["urgent", "plain-1", "plain-2", "batch-1", "batch-2"]


def test_without_priorities_the_seat_goes_by_arrival(checkpoint):
    engine = make_engine(checkpoint, max_num_seqs=1)
    for request_id in ["c", "a", "b"]:
        engine.add_request(request_id, PROMPT, GREEDY)
    assert first_token_order(engine) == ["c", "a", "b"]


def test_an_explicit_priority_argument_overrides_the_params(checkpoint):
    engine = make_engine(checkpoint, max_num_seqs=1)
    engine.add_request("params-first", PROMPT, replace(GREEDY, priority=-1))
    engine.add_request("argument-first", PROMPT, replace(GREEDY, priority=9), priority=-2)
    assert first_token_order(engine) == ["argument-first", "params-first"]


def test_a_received_request_keeps_its_priority(checkpoint):
    engine = make_engine(checkpoint)
    engine.handoff.reserve("r", len(PROMPT))
    state = engine.handoff.receive("r", PROMPT, 7, replace(GREEDY, priority=4))
    assert [sample.seq.priority for sample in state.samples] == [4]


@pytest.mark.parametrize("priority", [True, 1.5, "1", 2**31, -(2**31) - 1])
def test_an_invalid_priority_is_refused_naming_it(checkpoint, priority):
    engine = make_engine(checkpoint)
    with pytest.raises(InvalidArgument) as refused:
        engine.add_request("r", PROMPT, replace(GREEDY, priority=priority))
    assert refused.value.field == "priority"
    assert not engine.has_unfinished()


def test_the_int32_ends_are_taken():
    for priority in (-(2**31), 2**31 - 1):
        SamplingParams(priority=priority).validate()
