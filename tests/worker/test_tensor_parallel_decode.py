"""A tensor-parallel decode worker (2 gloo ranks on the CPU) taking KV from a prefill worker
over TCP: the handle names both ranks, each gets its KV heads' slice, and the streamed tokens
equal the single-process engine's (greedy, and seeded with n = 2). A transfer that breaks or
stalls on the second rank fails the request with the right status, and every rank's KV pool
is whole again afterwards (the followers answer over the lockstep pipe: `rank_snapshots`)."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from cleave.engine.llm import LLM
from cleave.generation.sampling_params import SamplingParams
from cleave.proto.cleave.v1 import common_pb2 as c
from cleave.proto.cleave.v1 import decode_pb2 as d
from cleave.proto.cleave.v1 import prefill_pb2 as p
from cleave.rpc.convert import transfer_handle_from_proto
from cleave.rpc.prefill_call import prefill_response
from cleave.transfer import connection
from tests.worker.cluster import (
    ENGINE_ARGS,
    GATEWAY,
    AttachReader,
    Running,
    greedy,
    start_decode,
    start_prefill,
    wait_pool_full,
)
from tests.worker.test_prefill_drives_decode import MAX_TOKENS, prompts, request

SEEDED = dict(temperature=0.9, seed=11, n=2)


@pytest.fixture(scope="module")
def reference(checkpoint):
    llm = LLM(checkpoint, **ENGINE_ARGS)
    return {
        "greedy": [o.outputs[0].token_ids for o in llm.generate(
            prompts(2), SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True))],
        "seeded": [[s.token_ids for s in o.outputs] for o in llm.generate(
            prompts(2), SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, **SEEDED))],
    }


@pytest.fixture
async def workers(checkpoint):
    """A prefill worker and a decode worker of 2 ranks; both closed (the rank process
    stopped) on every path."""
    decode = prefill = None
    try:
        decode = await start_decode(checkpoint, transfer_timeout_s=30.0, tensor_parallel_size=2)
        prefill = await start_prefill(checkpoint)
        yield decode, prefill
    finally:
        if prefill is not None:
            await prefill.close()
        if decode is not None:
            await decode.close()


def tp_request(request_id: str, prompt: list[int], decode_address: str, sampling: dict) -> p.PrefillRequest:
    message = request(request_id, prompt, decode_address)
    message.sampling.CopyFrom(c.SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, **{"temperature": 0.0, **sampling}))
    return message


async def every_rank_pool_full(decode: Running) -> None:
    """Rank 0's pool full (GetLoad), then every rank's (the followers apply the releases in
    the same order, before they answer)."""
    await wait_pool_full(decode.stub, timeout_s=20)
    snapshots = await decode.backend.async_engine.call(lambda e: e.rank_snapshots())
    assert len(snapshots) == 2
    assert all(s.num_free_blocks == s.num_usable_blocks for s in snapshots), snapshots


async def test_each_rank_receives_its_heads_and_the_tokens_match_one_process(workers, reference):
    decode, prefill = workers
    admitted = await decode.stub.Admit(d.AdmitRequest(
        request_id="probe", prompt_token_ids=prompts(1)[0], sampling=greedy(MAX_TOKENS), gateway_id=GATEWAY))
    handle = transfer_handle_from_proto(admitted.handle)
    [rank_1] = handle.rank_handles
    assert (handle.layout.heads, rank_1.layout.heads) == (range(0, 1), range(1, 2))
    assert rank_1.block_ids == handle.block_ids and rank_1.address != handle.address
    assert (await decode.stub.Abort(c.AbortRequest(request_id="probe"))).found

    reader = AttachReader(decode.stub)
    for name, sampling in (("greedy", {}), ("seeded", SEEDED)):
        ids = [f"{name}-{i}" for i in range(2)]
        results = await asyncio.gather(*(
            prefill_response(prefill.stub.Prefill(tp_request(rid, prompt, decode.server.address, sampling)))
            for rid, prompt in zip(ids, prompts(2))))
        num_samples = sampling.get("n", 1)
        await reader.wait_finished(ids, num_samples=num_samples, timeout_s=120)
        for rid, result, expected in zip(ids, results, reference[name]):
            samples = [expected] if name == "greedy" else expected
            for index, tokens in enumerate(samples):
                assert [result.first_token_ids[index], *reader.tokens(rid, index)] == tokens, (rid, index)
                assert reader.finish(rid, index) == c.FINISH_REASON_LENGTH
    assert prefill.backend.counters.transfers["tcp"].num_transfers == 4  # one per request, both ranks in it
    await every_rank_pool_full(decode)
    await wait_pool_full(prefill.stub)
    await reader.cancel()


def break_rank_connections(monkeypatch, addresses: list[str], *, stall: bool = False) -> None:
    """Bulk connections to `addresses` reset on their second chunk (or, with `stall`, drop
    every chunk silently: the rank's part then passes its deadline)."""
    real_write = connection.BulkConnection.write_chunk
    writes: dict[int, int] = {}

    async def write(bulk, header, payload=None):  # type: ignore[no-untyped-def]
        if bulk.address in addresses:
            writes[id(bulk)] = writes.get(id(bulk), 0) + 1
            if stall:
                return
            if writes[id(bulk)] > 1:
                raise ConnectionResetError("injected: connection to rank 1 reset mid-transfer")
        await real_write(bulk, header, payload)

    monkeypatch.setattr(connection.BulkConnection, "write_chunk", write)


async def test_a_transfer_torn_on_one_rank_is_unavailable_and_frees_every_rank(workers, monkeypatch):
    decode, prefill = workers
    break_rank_connections(monkeypatch, decode.backend.transfers.rank_addresses)
    reader = AttachReader(decode.stub)
    with pytest.raises(grpc.aio.AioRpcError) as failed:
        await prefill_response(prefill.stub.Prefill(request("torn", prompts(1)[0], decode.server.address)))
    assert failed.value.code() == grpc.StatusCode.UNAVAILABLE, failed.value.details()
    assert "mid-transfer" in failed.value.details()
    await every_rank_pool_full(decode)
    await wait_pool_full(prefill.stub, timeout_s=20)
    assert reader.tokens("torn") == []
    await reader.cancel()


async def test_a_rank_whose_part_passes_its_deadline_fails_the_request(checkpoint, monkeypatch):
    decode = prefill = None
    try:
        decode = await start_decode(checkpoint, transfer_timeout_s=3.0, tensor_parallel_size=2)
        prefill = await start_prefill(checkpoint)
        break_rank_connections(monkeypatch, decode.backend.transfers.rank_addresses, stall=True)
        reader = AttachReader(decode.stub)
        with pytest.raises(grpc.aio.AioRpcError) as failed:
            await prefill_response(prefill.stub.Prefill(request("late", prompts(1)[0], decode.server.address)))
        assert failed.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED, failed.value.details()
        await reader.wait_finished(["late"], timeout_s=30)  # the decode worker ended it with its reason
        assert reader.finish("late") == c.FINISH_REASON_ERROR
        assert reader.deltas("late")[-1].error.code == c.ERROR_CODE_DEADLINE_EXCEEDED
        await every_rank_pool_full(decode)
        await wait_pool_full(prefill.stub, timeout_s=20)
        await reader.cancel()
    finally:
        if prefill is not None:
            await prefill.close()
        if decode is not None:
            await decode.close()
