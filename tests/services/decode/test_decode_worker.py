"""Every Decode RPC on the engine-backed worker: results, errors, deadlines, cancellation,
and the KV pool back to full after each path."""

from __future__ import annotations

import asyncio
import threading

import grpc
import pytest

from cleave.generation.sampling_params import SamplingParams
from cleave.proto.cleave.v1 import common_pb2 as c
from cleave.proto.cleave.v1 import decode_pb2 as d
from services.decode.backend import StartSpec
from tests.worker.cluster import GATEWAY, MODEL_ID, AttachReader, greedy, wait_pool_full

PROMPT = list(range(10, 27))  # 17 tokens: 5 blocks of 4


def admit(request_id: str, prompt=PROMPT, max_tokens: int = 8, **kwargs) -> d.AdmitRequest:
    return d.AdmitRequest(request_id=request_id, prompt_token_ids=prompt, sampling=greedy(max_tokens, **kwargs),
                          gateway_id=GATEWAY)


async def test_load_reports_the_whole_pool(decode):
    load = (await decode.stub.GetLoad(c.GetLoadRequest())).load
    assert (load.worker_id, load.num_total_blocks, load.num_free_blocks, load.max_num_running) == (
        "decode-0", 64, 64, 256)


async def _num_attached(decode, expected: int) -> int:  # type: ignore[no-untyped-def]
    """The load's attached gateways once it is `expected` (or after 5 s)."""
    deadline = asyncio.get_running_loop().time() + 5
    while True:
        load = (await decode.stub.GetLoad(c.GetLoadRequest())).load
        if load.num_attached_gateways == expected or asyncio.get_running_loop().time() > deadline:
            return load.num_attached_gateways
        await asyncio.sleep(0.01)


async def test_load_counts_the_attached_gateways(decode):
    assert await _num_attached(decode, 0) == 0
    first, second = AttachReader(decode.stub, "gateway-a"), AttachReader(decode.stub, "gateway-b")
    assert await _num_attached(decode, 2) == 2
    await first.cancel()
    assert await _num_attached(decode, 1) == 1
    await second.cancel()
    assert await _num_attached(decode, 0) == 0


async def test_admit_reserves_blocks_and_abort_frees_them(decode):
    reader = AttachReader(decode.stub)
    handle = (await decode.stub.Admit(admit("a1"))).handle
    assert (handle.transport, len(handle.block_ids), handle.worker_id) == (c.TRANSPORT_KIND_TCP, 5, "decode-0")
    assert handle.layout.model_id == MODEL_ID and handle.layout.block_size == 4 and handle.address
    assert handle.HasField("deadline")
    load = (await decode.stub.GetLoad(c.GetLoadRequest())).load
    assert (load.num_free_blocks, load.num_waiting) == (59, 1)
    assert (await decode.stub.Abort(c.AbortRequest(request_id="a1"))).found
    assert not (await decode.stub.Abort(c.AbortRequest(request_id="a1"))).found
    await reader.wait_finished(["a1"])
    assert reader.finish("a1") == c.FINISH_REASON_ABORT
    await wait_pool_full(decode.stub)
    with pytest.raises(grpc.aio.AioRpcError) as raised:  # the transfer was cancelled with it
        await decode.stub.Start(d.StartRequest(request_id="a1", first_token_ids=[5]))
    assert raised.value.code() == grpc.StatusCode.NOT_FOUND
    await reader.cancel()


async def test_transfer_deadline_fails_the_request_and_frees_blocks(decode):
    reader = AttachReader(decode.stub)
    await decode.stub.Admit(admit("late"))
    await reader.wait_finished(["late"])  # nobody sends the KV: 0.5 s later it fails
    (delta,) = reader.deltas("late")
    assert delta.finish_reason == c.FINISH_REASON_ERROR
    assert delta.error.code == c.ERROR_CODE_DEADLINE_EXCEEDED and "blocks were freed" in delta.error.message
    await wait_pool_full(decode.stub)
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await decode.stub.Start(d.StartRequest(request_id="late", first_token_ids=[5]))
    assert raised.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    await reader.cancel()


async def test_start_waiting_for_kv_fails_at_the_deadline(decode):
    reader = AttachReader(decode.stub)
    await decode.stub.Admit(admit("wait"))
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await decode.stub.Start(d.StartRequest(request_id="wait", first_token_ids=[5]))
    assert raised.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    await reader.wait_finished(["wait"])
    assert reader.finish("wait") == c.FINISH_REASON_ERROR  # still exactly one end on the stream
    await wait_pool_full(decode.stub)
    await reader.cancel()


async def test_admit_errors(decode):
    for index in range(3):  # 3 x 20 of the 64 blocks
        await decode.stub.Admit(admit(f"fill{index}", prompt=list(range(1, 81))))
    decode.backend.admissions.queue.max_waiting = 0  # a full pool refuses at once, not after a wait in the queue
    cases = [
        (admit("big", prompt=list(range(1, 41))), grpc.StatusCode.RESOURCE_EXHAUSTED, "--max-queued-admissions 0"),
        (admit("n", n=2000), grpc.StatusCode.INVALID_ARGUMENT, "sampling.n"),
        (admit("vocab", prompt=[10**6]), grpc.StatusCode.INVALID_ARGUMENT, "prompt"),
        (admit("long", prompt=list(range(1, 250)), max_tokens=100), grpc.StatusCode.INVALID_ARGUMENT, "max_tokens"),
    ]
    for request, code, text in cases:
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            await decode.stub.Admit(request)
        assert raised.value.code() == code and text in raised.value.details(), raised.value.details()
    for index in range(3):
        assert (await decode.stub.Abort(c.AbortRequest(request_id=f"fill{index}"))).found
    await decode.stub.Admit(admit("dup"))
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await decode.stub.Admit(admit("dup"))
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(grpc.aio.AioRpcError) as raised:  # one first token per sample
        await decode.stub.Start(d.StartRequest(request_id="dup", first_token_ids=[5, 6]))
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await decode.stub.Start(d.StartRequest(request_id="nope", first_token_ids=[5]))
    assert raised.value.code() == grpc.StatusCode.NOT_FOUND and "call Admit first" in raised.value.details()
    assert (await decode.stub.Abort(c.AbortRequest(request_id="dup"))).found
    await wait_pool_full(decode.stub)


async def test_abort_running_and_attach_cancellation_free_everything(decode):
    reader = AttachReader(decode.stub)
    start = d.StartRequest(request_id="run", prefill_locally=True, prompt_token_ids=PROMPT,
                           sampling=greedy(200), gateway_id=GATEWAY)
    await decode.stub.Start(start)
    while not reader.tokens("run"):
        await asyncio.sleep(0.01)
    assert (await decode.stub.Abort(c.AbortRequest(request_id="run"))).found
    await reader.wait_finished(["run"])
    assert reader.finish("run") == c.FINISH_REASON_ABORT and len(reader.tokens("run")) < 200
    await wait_pool_full(decode.stub)
    # A gateway whose stream goes away takes its requests with it.
    await decode.stub.Start(d.StartRequest(request_id="orphan", prefill_locally=True, prompt_token_ids=PROMPT,
                                           sampling=greedy(200), gateway_id=GATEWAY))
    await decode.stub.Admit(admit("orphan-admitted"))
    while not reader.tokens("orphan"):
        await asyncio.sleep(0.01)
    await reader.cancel()
    await wait_pool_full(decode.stub)


async def test_second_attach_replaces_the_first(decode):
    first = AttachReader(decode.stub)
    await asyncio.sleep(0.05)
    second = AttachReader(decode.stub)
    await asyncio.wait_for(first.task, 5)  # ended cleanly, without aborting anything
    await decode.stub.Start(d.StartRequest(request_id="s", prefill_locally=True, prompt_token_ids=PROMPT,
                                           sampling=greedy(3), gateway_id=GATEWAY))
    await second.wait_finished(["s"])
    assert len(second.tokens("s")) == 3 and first.deltas("s") == []
    await second.cancel()


async def test_handshake_picks_tcp_on_cpu_and_checks_layouts(decode):
    handle = (await decode.stub.Admit(admit("h"))).handle
    layout = handle.layout
    response = await decode.stub.Handshake(d.HandshakeRequest(
        peer_id="prefill-0", supported_transports=[c.TRANSPORT_KIND_CUDA_IPC, c.TRANSPORT_KIND_TCP],
        host="elsewhere", layout=layout))
    assert (response.transport, response.rank, response.world_size, response.worker_id) == (
        c.TRANSPORT_KIND_TCP, 1, 2, "decode-0")
    assert response.tcp_address == handle.address and response.layout == layout
    wrong = c.KVLayout()
    wrong.CopyFrom(layout)
    wrong.head_dim += 1
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await decode.stub.Handshake(d.HandshakeRequest(peer_id="p", supported_transports=[1], layout=wrong))
    assert raised.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "head_dim" in raised.value.details()
    await decode.stub.Abort(c.AbortRequest(request_id="h"))
    await wait_pool_full(decode.stub)


async def test_two_admissions_of_one_id_at_once_admit_one_and_refuse_the_other(decode):
    """Both pass the id check before either registers (the admission awaits the transport and
    the reservation in between): the second is refused as a duplicate id, and the first's
    reservation is untouched."""
    results = await asyncio.gather(decode.stub.Admit(admit("twin")), decode.stub.Admit(admit("twin")),
                                   return_exceptions=True)
    errors = [result for result in results if isinstance(result, BaseException)]
    assert len(errors) == 1 and len(results) == 2
    (error,) = errors
    assert isinstance(error, grpc.aio.AioRpcError), error
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "request_id" in error.details(), error.details()
    assert (await decode.stub.Abort(c.AbortRequest(request_id="twin"))).found
    await wait_pool_full(decode.stub)


async def test_a_local_start_cancelled_while_its_prompt_is_queued_is_aborted(decode, monkeypatch):
    """The engine takes the prompt from its command queue even when the Start that put it
    there is cancelled (the gateway's client went away) before the engine answered: the
    request must end there as ABORT, not decode to max_tokens with nobody listening."""
    reader = AttachReader(decode.stub)
    async_engine = decode.backend.async_engine
    loop = asyncio.get_running_loop()
    posted, cancelled = asyncio.Event(), threading.Event()
    real_call = async_engine.call

    async def enqueue_after_the_cancel(fn):  # type: ignore[no-untyped-def]
        monkeypatch.setattr(async_engine, "call", real_call)  # only the Start's own call waits

        def run(engine):  # type: ignore[no-untyped-def]
            loop.call_soon_threadsafe(posted.set)
            cancelled.wait(10)
            return fn(engine)

        return await real_call(run)

    monkeypatch.setattr(async_engine, "call", enqueue_after_the_cancel)
    start = asyncio.ensure_future(decode.backend.start_request(StartSpec(
        request_id="gone", gateway_id=GATEWAY, prefill_locally=True, prompt_token_ids=tuple(PROMPT),
        sampling=SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True))))
    await posted.wait()
    start.cancel()
    await asyncio.gather(start, return_exceptions=True)
    cancelled.set()
    assert not await async_engine.call(lambda engine: engine.scheduler.has_unfinished()), "the prompt kept running"
    await reader.wait_finished(["gone"])
    assert reader.finish("gone") == c.FINISH_REASON_ABORT
    await wait_pool_full(decode.stub)
    await reader.cancel()
