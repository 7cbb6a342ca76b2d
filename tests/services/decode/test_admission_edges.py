"""Admissions at their edges on the engine-backed decode worker: a prompt that needs exactly
every usable block, a drain that begins while an admission reserves, an abort that disarms
the deadline, the bound on remembered failures (the oldest is forgotten first), sample aborts
before Start, a gateway's detach, a re-admitted id, a Start or an Admit that fails halfway,
and an Admit cancelled while the step thread reserves its blocks (each frees what it took)."""

from __future__ import annotations

import asyncio
import threading

import grpc
import pytest

from cleave.errors import Unavailable
from cleave.proto.cleave.v1 import common_pb2 as c
from cleave.proto.cleave.v1 import decode_pb2 as d
from services.decode import admission
from tests.worker.cluster import GATEWAY, AttachReader, greedy, start_decode, wait_pool_full

PROMPT = list(range(10, 27))  # 17 tokens: 5 blocks of 4


def admit(request_id: str, prompt: list[int], max_tokens: int = 3) -> d.AdmitRequest:
    return d.AdmitRequest(request_id=request_id, prompt_token_ids=prompt, sampling=greedy(max_tokens),
                          gateway_id=GATEWAY)


async def test_a_prompt_that_needs_exactly_every_usable_block_is_admitted(decode):
    total = (await decode.stub.GetLoad(c.GetLoadRequest())).load.num_total_blocks
    prompt = [7] * (4 * total - 3)  # 253 tokens: the last of the 64 blocks holds one
    handle = (await decode.stub.Admit(admit("whole", prompt))).handle
    assert len(handle.block_ids) == total
    assert (await decode.stub.GetLoad(c.GetLoadRequest())).load.num_free_blocks == 0
    assert (await decode.stub.Abort(c.AbortRequest(request_id="whole"))).found
    await wait_pool_full(decode.stub)


async def test_a_drain_that_begins_while_an_admission_reserves_frees_its_blocks(decode, monkeypatch):
    admissions = decode.backend.admissions
    reserve = admissions.queue.reserve

    async def reserve_then_drain(attempt, priority=0):  # type: ignore[no-untyped-def]
        block_ids = await reserve(attempt, priority)
        admissions.gate.close()  # the drain begins as the reservation comes back
        return block_ids

    monkeypatch.setattr(admissions.queue, "reserve", reserve_then_drain)
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await decode.stub.Admit(admit("late", PROMPT))
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    assert admissions.held("late") is None
    await wait_pool_full(decode.stub)  # the 5 reserved blocks came back


async def test_an_aborted_admission_disarms_its_deadline(decode):
    """Else the old deadline would fail a later admission of the same id before its own."""
    reader = AttachReader(decode.stub)
    await decode.stub.Admit(admit("again", PROMPT))
    deadline = decode.backend.admissions.held("again").timer
    assert deadline is not None and not deadline.cancelled()
    assert (await decode.stub.Abort(c.AbortRequest(request_id="again"))).found
    assert deadline.cancelled()
    await reader.wait_finished(["again"])
    assert reader.finish("again") == c.FINISH_REASON_ABORT
    await wait_pool_full(decode.stub)
    await reader.cancel()


async def test_failures_past_the_bound_forget_the_oldest_first(decode, monkeypatch):
    monkeypatch.setattr(admission, "MAX_REMEMBERED_FAILURES", 2)
    reader = AttachReader(decode.stub)
    ids = ["f0", "f1", "f2"]
    for request_id in ids:  # nobody sends their KV: they fail at their deadlines, in this order
        await decode.stub.Admit(admit(request_id, PROMPT))
    await reader.wait_finished(ids)
    codes = []
    for request_id in ids:
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            await decode.stub.Start(d.StartRequest(request_id=request_id, first_token_ids=[5]))
        codes.append(raised.value.code())
    assert codes == [grpc.StatusCode.NOT_FOUND, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.DEADLINE_EXCEEDED]
    await wait_pool_full(decode.stub)
    await reader.cancel()


async def test_a_sample_abort_before_start_ends_a_one_sample_admission_at_once(decode):
    reader = AttachReader(decode.stub)
    await decode.stub.Admit(admit("single", PROMPT))
    assert (await decode.stub.Abort(c.AbortRequest(request_id="single", sample_index=0))).found
    assert decode.backend.admissions.held("single") is None  # not left waiting for a Start
    await reader.wait_finished(["single"])
    assert reader.finish("single") == c.FINISH_REASON_ABORT
    await wait_pool_full(decode.stub)
    await reader.cancel()


async def test_a_sample_abort_before_start_past_the_last_sample_finds_nothing(decode):
    await decode.stub.Admit(d.AdmitRequest(request_id="pair", prompt_token_ids=PROMPT,
                                           sampling=greedy(3, n=2), gateway_id=GATEWAY))
    assert not (await decode.stub.Abort(c.AbortRequest(request_id="pair", sample_index=2))).found
    assert decode.backend.admissions.held("pair").aborted_samples == set()
    assert (await decode.stub.Abort(c.AbortRequest(request_id="pair", sample_index=1))).found
    assert decode.backend.admissions.held("pair").aborted_samples == {1}
    assert (await decode.stub.Abort(c.AbortRequest(request_id="pair"))).found
    await wait_pool_full(decode.stub)


async def test_a_gateway_whose_stream_ends_takes_only_its_own_admissions(checkpoint, monkeypatch):
    decode = await start_decode(checkpoint)  # deadlines far off: only the detach ends anything
    try:
        admissions = decode.backend.admissions
        detached = asyncio.Event()
        abort_gateway = admissions.abort_gateway

        def abort_gateway_and_tell(gateway_id: str) -> None:
            abort_gateway(gateway_id)
            detached.set()

        monkeypatch.setattr(admissions, "abort_gateway", abort_gateway_and_tell)
        leaving, staying = AttachReader(decode.stub, "gateway-a"), AttachReader(decode.stub, "gateway-b")
        for request_id, gateway_id in (("probe", "gateway-a"), ("mine", "gateway-a"), ("theirs", "gateway-b")):
            await decode.stub.Admit(d.AdmitRequest(request_id=request_id, prompt_token_ids=PROMPT,
                                                   sampling=greedy(3), gateway_id=gateway_id))
        assert (await decode.stub.Abort(c.AbortRequest(request_id="probe"))).found
        await leaving.wait_finished(["probe"])  # its ABORT came on the stream: gateway-a is attached
        await leaving.cancel()
        await asyncio.wait_for(detached.wait(), 5)
        assert admissions.held("mine") is None and admissions.held("theirs") is not None
        assert staying.deltas("theirs") == []
        assert (await decode.stub.Abort(c.AbortRequest(request_id="theirs"))).found
        await wait_pool_full(decode.stub)
        await staying.cancel()
    finally:
        await decode.close()


async def test_a_readmitted_id_forgets_its_earlier_failure(decode):
    """Start after the second admission was aborted: NOT_FOUND, not the first one's deadline."""
    reader = AttachReader(decode.stub)
    await decode.stub.Admit(admit("twice", PROMPT))
    await reader.wait_finished(["twice"])  # nobody sends the KV: it fails at its deadline
    assert reader.finish("twice") == c.FINISH_REASON_ERROR
    await decode.stub.Admit(admit("twice", PROMPT))
    assert (await decode.stub.Abort(c.AbortRequest(request_id="twice"))).found
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await decode.stub.Start(d.StartRequest(request_id="twice", first_token_ids=[5]))
    assert raised.value.code() == grpc.StatusCode.NOT_FOUND, raised.value.details()
    await wait_pool_full(decode.stub)
    await reader.cancel()



async def test_a_start_the_engine_refuses_frees_the_reservation(decode, monkeypatch):
    """The KV is in, but Start's own sampling params do not fit the prompt: the engine takes
    nothing, so the reservation is still this worker's to free."""
    await decode.stub.Admit(admit("refused", PROMPT))
    transfer = decode.backend.admissions.held("refused").transfer

    async def arrived() -> None:
        return None

    monkeypatch.setattr(transfer, "wait", arrived)
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await decode.stub.Start(d.StartRequest(request_id="refused", first_token_ids=[5], sampling=greedy(1000)))
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "max_tokens" in raised.value.details()
    assert decode.backend.admissions.held("refused") is None
    await wait_pool_full(decode.stub)


async def test_a_sample_aborted_before_start_ends_as_it_starts_and_the_other_runs_on(decode, monkeypatch):
    reader = AttachReader(decode.stub)
    await decode.stub.Admit(d.AdmitRequest(request_id="split", prompt_token_ids=PROMPT,
                                           sampling=greedy(4, n=2), gateway_id=GATEWAY))
    assert (await decode.stub.Abort(c.AbortRequest(request_id="split", sample_index=1))).found
    transfer = decode.backend.admissions.held("split").transfer

    async def arrived() -> None:  # the KV is in (its values do not matter here)
        return None

    monkeypatch.setattr(transfer, "wait", arrived)
    await decode.stub.Start(d.StartRequest(request_id="split", first_token_ids=[5, 6]))
    await reader.wait_finished(["split"], num_samples=2)
    assert (reader.finish("split", 0), reader.finish("split", 1)) == (c.FINISH_REASON_LENGTH, c.FINISH_REASON_ABORT)
    assert len(reader.tokens("split", 0)) == 4 and len(reader.tokens("split", 1)) < 4
    await wait_pool_full(decode.stub)
    await reader.cancel()


async def test_an_admission_whose_transfer_cannot_register_leaves_nothing_held(decode, monkeypatch):
    def refuse(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise Unavailable("the KV receiver is closing")

    monkeypatch.setattr(decode.backend.transfers, "expect", refuse)
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await decode.stub.Admit(admit("unregistered", PROMPT))
    assert raised.value.code() == grpc.StatusCode.UNAVAILABLE
    assert decode.backend.admissions.held("unregistered") is None
    await wait_pool_full(decode.stub)
    monkeypatch.undo()
    await decode.stub.Admit(admit("unregistered", PROMPT))  # the id is free again
    assert (await decode.stub.Abort(c.AbortRequest(request_id="unregistered"))).found
    await wait_pool_full(decode.stub)


async def test_an_admit_cancelled_while_the_step_thread_reserves_frees_the_blocks(decode, monkeypatch):
    """The prefill worker that sent it died or gave up: the step thread reserves anyway, and
    nothing else would ever free those blocks."""
    admissions, async_engine = decode.backend.admissions, decode.backend.async_engine
    stalled, go_on = threading.Event(), threading.Event()
    stall = asyncio.ensure_future(async_engine.call(lambda engine: (stalled.set(), go_on.wait(60))))
    try:
        await asyncio.to_thread(stalled.wait, 60)  # the step thread runs nothing else until go_on
        asked, cut = asyncio.Event(), asyncio.Event()
        call, reserve = async_engine.call, admissions.queue.reserve

        def asking(fn):  # type: ignore[no-untyped-def]
            asked.set()  # the Admit asks the step thread for its blocks
            return call(fn)

        async def noting_the_cut(attempt, priority=0):  # type: ignore[no-untyped-def]
            try:
                return await reserve(attempt, priority)
            except asyncio.CancelledError:
                cut.set()
                raise

        monkeypatch.setattr(async_engine, "call", asking)
        monkeypatch.setattr(admissions.queue, "reserve", noting_the_cut)
        admitting = decode.stub.Admit(admit("cut", PROMPT))
        await asyncio.wait_for(asked.wait(), 60)
        admitting.cancel()
        await asyncio.wait_for(cut.wait(), 60)  # the cancel reached the worker's Admit
    finally:
        go_on.set()
        await stall
    await wait_pool_full(decode.stub)  # the 5 blocks the step thread reserved after the cancel came back
    assert admissions.held("cut") is None
