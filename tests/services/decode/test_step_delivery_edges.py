"""StepDelivery at its edges, over a fake request table and fake gateway streams: every step
wakes the admission queue, the token rate counts tokens, the first-step span is recorded once,
and a first token the client already has takes its reasoning count with it."""

from __future__ import annotations

import asyncio

from cleave.engine.step_trace import TraceOrigin
from cleave.generation.outputs import CompletionOutput, FinishReason, RequestOutput
from cleave.generation.sampling_params import SamplingParams
from cleave.rpc.types import RequestDelta
from services.decode.admission import HeldRequest
from services.decode.step_delivery import StepDelivery, without_delivered_first
from tests.tracing.helpers import memory_tracing, traced_caller

GATEWAY = "gateway-0"


class Table:
    """What StepDelivery reads of `Admissions`: the held requests, `finish` and `wake`."""

    def __init__(self, *requests: HeldRequest) -> None:
        self.requests = {request.request_id: request for request in requests}
        self.finished: list[str] = []
        self.num_wakes = 0

    def held(self, request_id: str) -> HeldRequest | None:
        return self.requests.get(request_id)

    def finish(self, request_id: str) -> None:
        del self.requests[request_id]
        self.finished.append(request_id)

    def wake(self) -> None:
        self.num_wakes += 1


class Streams:
    """Gateway streams that record each publish and signal it."""

    def __init__(self) -> None:
        self.published: list[tuple[str, list[RequestDelta], int]] = []
        self.news = asyncio.Event()

    def publish(self, gateway_id: str, deltas: list[RequestDelta], step: int) -> None:
        self.published.append((gateway_id, list(deltas), step))
        self.news.set()


def held(request_id: str, **fields) -> HeldRequest:  # type: ignore[no-untyped-def]
    return HeldRequest(request_id, GATEWAY, [1, 2, 3], SamplingParams(max_tokens=8), started=True, **fields)


def output(request_id: str, *samples: list[int], finished: bool = False) -> RequestOutput:
    return RequestOutput(request_id, [], [
        CompletionOutput(index, token_ids=tokens, finish_reason=FinishReason.LENGTH if finished else None)
        for index, tokens in enumerate(samples)], finished=finished)


async def delivered(delivery: StepDelivery, streams: Streams, outputs: list[RequestOutput]) -> None:
    """Run one engine step's outputs through `on_step` and wait for them on the streams."""
    streams.news.clear()
    delivery.on_step(outputs)
    await asyncio.wait_for(streams.news.wait(), 5)


async def test_every_step_wakes_the_admission_queue_after_finishing_its_requests():
    table, streams = Table(held("done"), held("going")), Streams()
    delivery = StepDelivery(table, streams)  # type: ignore[arg-type]
    delivery.start(asyncio.get_running_loop())
    await delivered(delivery, streams, [output("done", [4], finished=True), output("going", [5])])
    assert table.finished == ["done"] and table.num_wakes == 1  # the finished request's blocks are free
    await delivered(delivery, streams, [output("going", [6])])
    assert table.num_wakes == 2
    assert [(gateway, [d.request_id for d in deltas], step) for gateway, deltas, step in streams.published] == [
        (GATEWAY, ["done", "going"], 1), (GATEWAY, ["going"], 2)]


async def test_the_token_rate_counts_tokens_not_deltas():
    table, streams = Table(held("r")), Streams()
    delivery = StepDelivery(table, streams)  # type: ignore[arg-type]
    delivery.start(asyncio.get_running_loop())
    assert delivery.tokens_per_second() == 0.0
    await delivered(delivery, streams, [output("r", [4, 5, 6], [7, 8, 9])])  # two deltas, six tokens
    assert delivery.tokens_per_second() == 6.0  # within the first second the rate is the count


async def test_the_first_step_span_is_recorded_once_per_request():
    tracing, exporter = memory_tracing("cleave-decode")
    with traced_caller(tracing):
        origin = TraceOrigin.capture()
    assert origin is not None
    table, streams = Table(held("traced", trace_start=origin)), Streams()
    delivery = StepDelivery(table, streams)  # type: ignore[arg-type]
    delivery.start(asyncio.get_running_loop())
    for token in (4, 5, 6):
        await delivered(delivery, streams, [output("traced", [token])])
    spans = [span for span in exporter.get_finished_spans() if span.name == "decode.first_step"]
    assert len(spans) == 1 and dict(spans[0].attributes) == {"request_id": "traced"}
    assert table.requests["traced"].trace_start is None


def test_a_delivered_first_token_takes_its_reasoning_count_with_it():
    """The first token was a reasoning token the client already counted: what is left of
    the delta counts at most its own tokens."""
    delivered_first = {0, 1}
    kept = without_delivered_first([
        RequestDelta("r", 0, (7, 8), num_reasoning_tokens=2),
        RequestDelta("r", 1, (9,), FinishReason.LENGTH, num_reasoning_tokens=1),
    ], delivered_first)
    assert [(d.sample_index, d.token_ids, d.finish_reason, d.num_reasoning_tokens) for d in kept] == [
        (0, (8,), None, 1), (1, (), FinishReason.LENGTH, 0)]
    assert delivered_first == set()
