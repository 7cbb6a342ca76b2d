"""Decode placement on fake decode workers (no servers): which worker a request gets, which
worker requests are aborted when a request leaves them, and a broken Attach stream that is
reopened once its worker is healthy again. A fake stub hands out Attach calls that stay open
until the test ends them and records every Abort."""

from __future__ import annotations

import asyncio

import pytest_asyncio

from cleave.proto.cleave.v1 import common_pb2
from services.gateway.placement import BLOCK_SIZE_ESTIMATE, DecodePlacement
from services.gateway.workers import WorkerHandle, WorkerPool


class FakeAttachCall:
    """An Attach call that sends no steps: it ends when the worker closes it (`end`) or the
    gateway cancels it (`cancel`, which the reader sees as CancelledError, as with gRPC)."""

    def __init__(self) -> None:
        self._ended = asyncio.Event()
        self._cancelled = False

    def end(self) -> None:
        self._ended.set()

    def cancel(self) -> None:
        self._cancelled = True
        self._ended.set()

    def __aiter__(self):  # type: ignore[no-untyped-def]
        return self._steps()

    async def _steps(self):  # type: ignore[no-untyped-def]
        await self._ended.wait()
        if self._cancelled:
            raise asyncio.CancelledError
        return
        yield  # an async generator that yields nothing


class FakeDecodeStub:
    """Records the Attach calls it opened and the request ids it was asked to abort."""

    def __init__(self) -> None:
        self.attach_calls: list[FakeAttachCall] = []
        self.aborted: list[str] = []

    def Attach(self, request):  # type: ignore[no-untyped-def]
        call = FakeAttachCall()
        self.attach_calls.append(call)
        return call

    async def Abort(self, request, timeout=None):  # type: ignore[no-untyped-def]
        self.aborted.append(request.request_id)


class Placement:
    """A `DecodePlacement` over a pool of fake decode workers; `closed` is set once a
    worker's stream broke and the worker left the rotation."""

    def __init__(self) -> None:
        self.pool = WorkerPool([], [], on_change=self._on_change)
        self.closed = asyncio.Event()
        self.placement = DecodePlacement(self.pool, "gw-test", on_stream_closed=self._on_stream_closed)

    async def _on_change(self, worker: WorkerHandle) -> None:
        await self.placement.on_worker_change(worker)

    async def _on_stream_closed(self, worker: WorkerHandle) -> None:
        self.closed.set()

    async def add_decode(self, address: str, **load) -> WorkerHandle:  # type: ignore[no-untyped-def]
        """A decode worker with this load that comes into rotation (its stream opens)."""
        worker = WorkerHandle("decode", address, None, FakeDecodeStub(), None,  # type: ignore[arg-type]
                              load=common_pb2.WorkerLoad(**load))
        self.pool.workers.append(worker)
        await self.pool.set_healthy(worker, True)
        return worker


@pytest_asyncio.fixture(loop_scope="function")
async def gateway():
    gateway = Placement()
    yield gateway
    await gateway.placement.close()


async def aborted(gateway: Placement, worker: WorkerHandle) -> list[str]:
    """The request ids aborted on `worker`, once every abort sent so far has arrived."""
    await gateway.placement.close()  # waits for the aborts still being sent
    return worker.stub.aborted


async def test_a_worker_whose_stream_broke_is_a_candidate_again_once_healthy(gateway):
    worker = await gateway.add_decode("d1")
    assert gateway.placement.candidates() == [worker]
    worker.stub.attach_calls[0].end()  # the worker closed its token stream
    await asyncio.wait_for(gateway.closed.wait(), 5)
    assert not worker.healthy and gateway.placement.candidates() == []
    await gateway.pool.set_healthy(worker, True)
    assert len(worker.stub.attach_calls) == 2  # a new stream was opened
    assert gateway.placement.candidates() == [worker]


async def test_placement_needs_room_for_the_prompt_and_the_first_token(gateway):
    prompt_blocks = 16 // BLOCK_SIZE_ESTIMATE
    await gateway.add_decode("tight", num_running=0, num_free_blocks=prompt_blocks, num_total_blocks=100)
    roomy = await gateway.add_decode("roomy", num_running=1, num_free_blocks=50, num_total_blocks=100)
    assert gateway.placement.place(num_prompt_tokens=16, num_samples=1).decode is roomy


async def test_request_sample_is_none_past_the_last_sample_and_for_a_left_worker_request(gateway):
    await gateway.add_decode("d1")
    running = gateway.placement.place(num_prompt_tokens=4, num_samples=2)
    (part,) = running.parts.values()
    assert running.request_sample(part.worker_request_id, 1) == 1
    assert running.request_sample(part.worker_request_id, 2) is None
    assert running.request_sample(part.worker_request_id, -1) is None
    assert running.request_sample("req-unknown", 0) is None


async def test_leaving_a_finished_worker_request_sends_no_abort(gateway):
    worker = await gateway.add_decode("d1")
    running = gateway.placement.place(num_prompt_tokens=4, num_samples=1)
    (part,) = running.parts.values()
    gateway.placement.leave(running, part, abort=False)
    assert worker.in_flight == 0 and running.parts == {}
    assert await aborted(gateway, worker) == []


async def test_leaving_a_part_twice_counts_it_out_once(gateway):
    worker = await gateway.add_decode("d1")
    running = gateway.placement.place(num_prompt_tokens=4, num_samples=1)
    (part,) = running.parts.values()
    gateway.placement.leave(running, part, abort=True)
    gateway.placement.leave(running, part, abort=True)
    assert worker.in_flight == 0
    assert await aborted(gateway, worker) == [part.worker_request_id]


async def test_leaving_cancels_a_pending_kv_handoff(gateway):
    await gateway.add_decode("d1")
    running = gateway.placement.place(num_prompt_tokens=4, num_samples=1)
    (part,) = running.parts.values()
    part.handoff = asyncio.get_running_loop().create_future()
    gateway.placement.leave(running, part, abort=True)
    assert part.handoff.cancelled()


async def test_renew_aborts_the_old_worker_request_on_the_same_worker(gateway):
    worker = await gateway.add_decode("d1")
    running = gateway.placement.place(num_prompt_tokens=4, num_samples=2)
    (old,) = running.parts.values()
    renewed = gateway.placement.renew(running, old)
    assert renewed.decode is worker and renewed.sample_indices == old.sample_indices
    assert list(running.parts) == [renewed.worker_request_id] and worker.in_flight == 1
    assert await aborted(gateway, worker) == [old.worker_request_id]


async def test_leave_all_aborts_a_worker_request_with_any_sample_unfinished(gateway):
    worker = await gateway.add_decode("d1")
    running = gateway.placement.place(num_prompt_tokens=4, num_samples=3)
    (first,) = running.parts.values()
    first.sample_indices = (0, 1)  # as after sample 2 moved to a worker request of its own
    moved = gateway.placement.place_samples(4, (2,), running.queue)
    running.add(moved)
    gateway.placement.leave_all(running, finished=lambda sample_index: sample_index in (0, 2))
    assert running.parts == {} and worker.in_flight == 0
    assert await aborted(gateway, worker) == [first.worker_request_id]  # sample 1 still decodes there
