"""A decode worker's StepOutput on the wire and back as the gateway reads it: what each delta
sets survives, what it leaves unset reads as the default."""

from __future__ import annotations

from cleave.proto.cleave.v1 import decode_pb2
from cleave.rpc.types import ErrorInfo, FinishReason, RequestDelta, StepOutput, TokenLogprob, TopLogprobs, WorkerLoad
from services.decode.servicer import step_output_to_proto
from services.gateway.convert import TokenDelta, token_delta_from_proto

LOGPROB = TopLogprobs(sampled=TokenLogprob(token_id=4, logprob=-0.5, rank=2),
                      top=(TokenLogprob(token_id=9, logprob=-0.25, rank=1), TokenLogprob(token_id=4, logprob=-0.5, rank=2)))


def over_the_wire(output: StepOutput) -> decode_pb2.StepOutput:
    return decode_pb2.StepOutput.FromString(step_output_to_proto(output).SerializeToString())


def test_plain_finished_logprob_reasoning_and_failed_deltas_round_trip():
    deltas = (
        RequestDelta("a", 0, (11,)),
        RequestDelta("a", 1, (12, 13), FinishReason.LENGTH, num_reasoning_tokens=2),
        RequestDelta("b", 0, (4,), logprobs=(LOGPROB,), prompt_logprobs=(LOGPROB, LOGPROB)),
        RequestDelta("c", 0, (), FinishReason.ERROR, error=ErrorInfo(code="UNAVAILABLE", message="peer lost", field="")),
    )
    message = over_the_wire(StepOutput(7, deltas, WorkerLoad(num_running=3)))
    assert message.step == 7 and message.load.num_running == 3
    assert [d.request_id for d in message.deltas] == ["a", "a", "b", "c"]
    assert [d.num_reasoning_tokens for d in message.deltas] == [0, 2, 0, 0]
    read = [token_delta_from_proto(d) for d in message.deltas]
    assert read[0] == TokenDelta(0, (11,))
    assert read[1] == TokenDelta(1, (12, 13), FinishReason.LENGTH)
    assert read[2] == TokenDelta(0, (4,), logprobs=(LOGPROB,), prompt_logprobs=(LOGPROB, LOGPROB))
    assert read[3] == TokenDelta(0, (), FinishReason.ERROR, error_message="peer lost")
    assert message.deltas[3].error.request_id == "c"


def test_a_plain_delta_sets_only_its_id_sample_and_tokens():
    (entry,) = over_the_wire(StepOutput(1, (RequestDelta("a", 2, (5,)),))).deltas
    assert [field.name for field, _ in entry.ListFields()] == ["request_id", "sample_index", "token_ids"]
