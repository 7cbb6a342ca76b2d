"""Prefill(decode = target): the prefill worker admits the request on the decode worker while
the prompt runs, ships the KV and starts the decode; the first tokens come back in the
Prefill stream's first message, ahead of the KV, and the Attach stream carries only the
tokens after them. Every failure frees the blocks on both ends."""

from __future__ import annotations

import asyncio
import random

import grpc
import pytest

from cleave.engine.llm import LLM
from cleave.generation.sampling_params import SamplingParams
from cleave.proto.cleave.v1 import common_pb2 as c
from cleave.proto.cleave.v1 import decode_pb2 as d
from cleave.proto.cleave.v1 import prefill_pb2 as p
from cleave.rpc.errors import error_detail
from cleave.rpc.prefill_call import prefill_response
from tests.worker.cluster import (
    ENGINE_ARGS,
    GATEWAY,
    AttachReader,
    BrokenBulkConnection,
    check_torn_transfer,
    greedy,
    start_decode,
    start_prefill,
    wait_pool_full,
)

MAX_TOKENS = 10


def prompts(count: int, seed: int = 1) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(5, 500) for _ in range(rng.randint(9, 30))] for _ in range(count)]


def request(request_id: str, prompt: list[int], decode_address: str, **sampling) -> p.PrefillRequest:
    return p.PrefillRequest(
        request_id=request_id, prompt_token_ids=prompt, sampling=greedy(MAX_TOKENS, **sampling),
        decode=p.DecodeTarget(address=decode_address, gateway_id=GATEWAY))


@pytest.fixture(scope="module")
def reference(checkpoint):
    llm = LLM(checkpoint, **ENGINE_ARGS)
    outputs = llm.generate(prompts(3), SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True))
    return [output.outputs[0].token_ids for output in outputs]


async def test_one_call_prefills_admits_and_starts(checkpoint, reference):
    decode, prefill = await start_decode(checkpoint), await start_prefill(checkpoint)
    try:
        reader = AttachReader(decode.stub)
        ids = [f"r{i}" for i in range(3)]
        results = await asyncio.gather(*(
            prefill_response(prefill.stub.Prefill(request(rid, prompt, decode.server.address, logprobs=2)))
            for rid, prompt in zip(ids, prompts(3))))
        await reader.wait_finished(ids)
        for rid, result, expected in zip(ids, results, reference):
            assert list(result.first_token_ids) == expected[:1]
            assert len(result.first_token_logprobs) == 1
            assert reader.tokens(rid) == expected[1:]  # the first token is not sent again
            # the logprobs of the streamed tokens stay aligned with them
            assert all(len(x.logprobs) == len(x.token_ids) for x in reader.deltas(rid))
            assert reader.finish(rid) == c.FINISH_REASON_LENGTH
        await wait_pool_full(decode.stub)
        await wait_pool_full(prefill.stub)
        await reader.cancel()
    finally:
        await prefill.close()
        await decode.close()


async def test_the_first_tokens_come_before_the_kv_is_sent(checkpoint, reference):
    """Two messages: the first tokens while the KV send is held back, then the transfer."""
    decode, prefill = await start_decode(checkpoint), await start_prefill(checkpoint)
    release = asyncio.Event()
    send = prefill.backend._send

    async def held_send(*args, **kwargs):  # type: ignore[no-untyped-def]
        await release.wait()
        return await send(*args, **kwargs)

    prefill.backend._send = held_send
    try:
        reader = AttachReader(decode.stub)
        call = prefill.stub.Prefill(request("early", prompts(1)[0], decode.server.address))
        first = await asyncio.wait_for(call.read(), 10)
        assert list(first.first_token_ids) == reference[0][:1] and not first.HasField("transfer")
        assert (first.num_prompt_tokens, first.num_computed_tokens) == (len(prompts(1)[0]), len(prompts(1)[0]))
        assert not release.is_set()
        release.set()
        delivered = await asyncio.wait_for(call.read(), 10)
        assert delivered.request_id == "early" and not delivered.first_token_ids
        assert delivered.transfer.num_blocks == -(-len(prompts(1)[0]) // 4)
        assert await call.read() is grpc.aio.EOF
        await reader.wait_finished(["early"])
        assert reader.tokens("early") == reference[0][1:]
        await wait_pool_full(decode.stub)
        await wait_pool_full(prefill.stub)
        await reader.cancel()
    finally:
        release.set()
        await prefill.close()
        await decode.close()


async def test_a_full_decode_pool_queues_the_admission_until_blocks_free(checkpoint):
    decode, prefill = await start_decode(checkpoint), await start_prefill(checkpoint)
    try:
        reader = AttachReader(decode.stub)
        # Another request holds 60 of the decode worker's 64 usable blocks.
        await decode.stub.Admit(d.AdmitRequest(
            request_id="hog", prompt_token_ids=[7] * 240, sampling=greedy(1), gateway_id=GATEWAY))
        waiting = asyncio.ensure_future(prefill_response(prefill.stub.Prefill(
            request("queued", prompts(1)[0] + [9] * 20, decode.server.address))))  # needs more than the 4 left
        deadline = asyncio.get_running_loop().time() + 10
        while decode.backend.admissions.queue.num_waiting == 0:  # the Admit waits for blocks, not refused
            assert asyncio.get_running_loop().time() < deadline and not waiting.done()
            await asyncio.sleep(0.01)
        await decode.stub.Abort(c.AbortRequest(request_id="hog"))
        result = await asyncio.wait_for(waiting, 10)
        await reader.wait_finished(["queued"])
        assert len([*result.first_token_ids, *reader.tokens("queued")]) == MAX_TOKENS
        assert reader.finish("queued") == c.FINISH_REASON_LENGTH
        await wait_pool_full(decode.stub)
        await wait_pool_full(prefill.stub)
        await reader.cancel()
    finally:
        await prefill.close()
        await decode.close()


async def test_a_full_decode_pool_past_the_queue_bound_is_resource_exhausted(checkpoint):
    decode, prefill = await start_decode(checkpoint, max_queued_admissions=0), await start_prefill(checkpoint)
    try:
        # Another request holds 60 of the decode worker's 64 usable blocks.
        await decode.stub.Admit(d.AdmitRequest(
            request_id="hog", prompt_token_ids=[7] * 240, sampling=greedy(1), gateway_id=GATEWAY))
        with pytest.raises(grpc.aio.AioRpcError) as failed:
            await prefill_response(prefill.stub.Prefill(request("big", prompts(1)[0] + [9] * 20, decode.server.address)))
        assert failed.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "decode worker" in failed.value.details() and "--max-queued-admissions" in failed.value.details()
        await decode.stub.Abort(c.AbortRequest(request_id="hog"))
        await wait_pool_full(decode.stub)
        await wait_pool_full(prefill.stub)
    finally:
        await prefill.close()
        await decode.close()


async def test_an_unreachable_decode_worker_is_unavailable_naming_decode(checkpoint, unused_tcp_port):
    prefill = await start_prefill(checkpoint)
    try:
        with pytest.raises(grpc.aio.AioRpcError) as failed:
            await prefill_response(prefill.stub.Prefill(request("lost", prompts(1)[0], f"127.0.0.1:{unused_tcp_port}")))
        assert failed.value.code() == grpc.StatusCode.UNAVAILABLE
        assert error_detail(failed.value).field == "decode"
        await wait_pool_full(prefill.stub)
    finally:
        await prefill.close()


async def test_destination_and_decode_together_are_refused(checkpoint):
    prefill = await start_prefill(checkpoint)
    try:
        both = request("both", prompts(1)[0], "127.0.0.1:1")
        both.destination.transfer_id = "t"
        with pytest.raises(grpc.aio.AioRpcError) as failed:
            await prefill_response(prefill.stub.Prefill(both))
        assert failed.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert error_detail(failed.value).field == "decode"
    finally:
        await prefill.close()


async def test_a_cancelled_prefill_frees_the_decode_reservation(checkpoint):
    decode, prefill = await start_decode(checkpoint), await start_prefill(checkpoint)
    try:
        reader = AttachReader(decode.stub)
        admitted = asyncio.Event()
        real_admit = decode.backend.admit

        async def admit_then_signal(spec):  # type: ignore[no-untyped-def]
            try:
                return await real_admit(spec)
            finally:
                admitted.set()

        decode.backend.admit = admit_then_signal
        call = prefill.stub.Prefill(request("gone", prompts(1)[0], decode.server.address))
        await asyncio.wait_for(admitted.wait(), 10)
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await prefill_response(call)
        await wait_pool_full(decode.stub, timeout_s=10)
        await wait_pool_full(prefill.stub, timeout_s=10)
        await reader.cancel()
    finally:
        await prefill.close()
        await decode.close()


async def test_start_with_delivered_first_tokens_streams_only_the_rest(checkpoint, reference):
    """The gateway-driven path still works: Admit, Prefill(destination), Start with
    first_tokens_delivered."""
    decode, prefill = await start_decode(checkpoint), await start_prefill(checkpoint)
    try:
        reader = AttachReader(decode.stub)
        prompt = prompts(1)[0]
        admitted = await decode.stub.Admit(d.AdmitRequest(
            request_id="g", prompt_token_ids=prompt, sampling=greedy(MAX_TOKENS), gateway_id=GATEWAY))
        result = await prefill_response(prefill.stub.Prefill(p.PrefillRequest(
            request_id="g", prompt_token_ids=prompt, sampling=greedy(MAX_TOKENS), destination=admitted.handle)))
        await decode.stub.Start(d.StartRequest(request_id="g", first_token_ids=result.first_token_ids,
                                               gateway_id=GATEWAY, first_tokens_delivered=True))
        await reader.wait_finished(["g"])
        assert [*result.first_token_ids, *reader.tokens("g")] == reference[0]
        await reader.cancel()
    finally:
        await prefill.close()
        await decode.close()


async def test_a_transfer_that_fails_mid_layer_frees_both_ends(checkpoint, monkeypatch):
    """The bulk connection drops after the first layer: the call fails with UNAVAILABLE naming
    the decode worker, the decode worker's reservation and the prefill's export are freed."""
    decode, prefill = await start_decode(checkpoint), await start_prefill(checkpoint)
    BrokenBulkConnection(monkeypatch, num_chunks=1)
    try:
        reader = AttachReader(decode.stub)
        with pytest.raises(grpc.aio.AioRpcError) as failed:
            await prefill_response(prefill.stub.Prefill(request("torn", prompts(1)[0], decode.server.address)))
        await check_torn_transfer(failed.value, decode, prefill, reader, "torn")
        await reader.cancel()
    finally:
        await prefill.close()
        await decode.close()


async def test_a_receiver_that_drops_the_bulk_connection_is_unavailable_naming_decode(checkpoint, monkeypatch):
    """The bulk connection's own report of a receiver gone (`Unavailable`, as when the decode
    worker dies mid-transfer) names the decode worker too, so the gateway moves the request
    instead of taking the prefill worker out of rotation; both pools are freed."""
    from cleave.errors import Unavailable
    from cleave.transfer import connection

    real_write = connection.BulkConnection.write_chunk
    writes = 0

    async def write_then_drop(bulk, header, payload=None):  # type: ignore[no-untyped-def]
        nonlocal writes
        writes += 1
        if writes > 1:
            raise Unavailable(f"KV receiver at {bulk.address} dropped the connection: injected")
        await real_write(bulk, header, payload)

    decode, prefill = await start_decode(checkpoint), await start_prefill(checkpoint)
    monkeypatch.setattr(connection.BulkConnection, "write_chunk", write_then_drop)
    try:
        reader = AttachReader(decode.stub)
        with pytest.raises(grpc.aio.AioRpcError) as failed:
            await prefill_response(prefill.stub.Prefill(request("dropped", prompts(1)[0], decode.server.address)))
        assert "dropped the connection" in failed.value.details()
        await check_torn_transfer(failed.value, decode, prefill, reader, "dropped")
        await reader.cancel()
    finally:
        await prefill.close()
        await decode.close()
