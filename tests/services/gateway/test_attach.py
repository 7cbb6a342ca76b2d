"""The decode worker's token stream demultiplexed into request queues: a delta that waits in
a queue behind another holds its own memory, not its whole step's, and a sample's later deltas
merge into it (`DeltaQueue`), so a client that stops reading keeps its own tokens alone, in one
message a sample, never the other requests' deltas of each step."""

from __future__ import annotations

from types import SimpleNamespace

from cleave.proto.cleave.v1 import common_pb2, decode_pb2
from services.gateway.attach import AttachStream, WorkerLost


class StepsCall:
    """An Attach call that sends `steps` (each parsed from its bytes, as gRPC does) and ends."""

    def __init__(self, steps: list[decode_pb2.StepOutput]) -> None:
        self.sent = [decode_pb2.StepOutput.FromString(step.SerializeToString()) for step in steps]

    def cancel(self) -> bool:
        return True

    async def __aiter__(self):  # type: ignore[no-untyped-def]
        for step in self.sent:
            yield step


def step(number: int, *deltas: tuple[str, int, int]) -> decode_pb2.StepOutput:
    return decode_pb2.StepOutput(step=number, deltas=[
        decode_pb2.RequestDelta(request_id=request_id, sample_index=sample, token_ids=[token])
        for request_id, sample, token in deltas
    ])


async def read_all(steps: list[decode_pb2.StepOutput], *request_ids: str) -> tuple[StepsCall, dict[str, list]]:
    """Every request's queued items once the stream has sent `steps` and ended, none read meanwhile."""
    call = StepsCall(steps)
    worker = SimpleNamespace(address="fake:0", load=common_pb2.WorkerLoad(),
                             stub=SimpleNamespace(Attach=lambda request: call))
    stream = AttachStream(worker, "gateway-0")  # type: ignore[arg-type]
    stream.is_open = True
    queues = {request_id: stream.register(request_id) for request_id in request_ids}
    stream.open()
    await stream._task  # type: ignore[misc]
    return call, {request_id: [queue.get_nowait() for _ in range(queue.qsize())] for request_id, queue in queues.items()}


def views_of_the_steps(call: StepsCall, items: list) -> list[int]:
    """Indexes of the queued deltas that still share memory with the step they came in:
    changing the step's copy of a delta shows in a view, not in a detached copy."""
    marker = 999_999
    for sent in call.sent:
        for delta in sent.deltas:
            delta.token_ids.append(marker)
    return [index for index, item in enumerate(items)
            if isinstance(item, decode_pb2.RequestDelta) and marker in item.token_ids]


async def test_an_unread_request_holds_its_tokens_in_one_copy_behind_its_first_delta():
    steps = [step(number, ("unread", 0, 10 + number), ("other", 0, 20 + number)) for number in range(5)]
    call, queued = await read_all(steps, "unread", "other")
    items = queued["unread"]
    assert [list(item.token_ids) for item in items[:-1]] == [[10], [11, 12, 13, 14]]
    assert isinstance(items[-1], WorkerLost)  # the stream's end follows the deltas
    assert views_of_the_steps(call, items) == [0]  # the first as it came (taken within its step), then a copy
    assert all(item.request_id == "unread" for item in items[:-1])


async def test_a_requests_samples_keep_their_own_tokens_in_order():
    steps = [step(0, ("n2", 0, 1), ("n2", 1, 2)), step(1, ("n2", 1, 3), ("n2", 0, 4)), step(2, ("n2", 0, 5))]
    call, queued = await read_all(steps, "n2")
    items = queued["n2"][:-1]
    assert [(item.sample_index, list(item.token_ids)) for item in items] == [(0, [1]), (1, [2, 3]), (0, [4, 5])]
    assert views_of_the_steps(call, items) == [0]


async def test_deltas_of_unregistered_requests_are_dropped_and_leave_the_queues_alone():
    call, queued = await read_all([step(0, ("gone", 0, 1), ("mine", 0, 2))], "mine")
    assert [list(item.token_ids) for item in queued["mine"][:-1]] == [[2]]
