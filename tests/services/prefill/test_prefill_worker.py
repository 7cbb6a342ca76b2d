"""The Prefill RPC on the engine-backed worker: first tokens, accounting, errors, transfer
failures and cancellation, with the KV pool back to full after each."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from cleave.engine.llm import LLM
from cleave.generation.sampling_params import SamplingParams
from cleave.proto.cleave.v1 import common_pb2 as c
from cleave.proto.cleave.v1 import decode_pb2 as d
from cleave.proto.cleave.v1 import prefill_pb2 as p
from cleave.rpc.prefill_call import prefill_response
from tests.worker.cluster import ENGINE_ARGS, GATEWAY, MODEL_ID, greedy, start_decode, wait_pool_full

PROMPT = list(range(30, 49))  # 19 tokens: 5 blocks of 4


async def test_compute_only_prefill_matches_llm_first_token(prefill, checkpoint):
    (expected,) = LLM(checkpoint, **ENGINE_ARGS).generate(PROMPT, SamplingParams(max_tokens=1, temperature=0.0))
    response = await prefill_response(prefill.stub.Prefill(p.PrefillRequest(
        request_id="c1", prompt_token_ids=PROMPT, sampling=greedy(4, logprobs=2), model=MODEL_ID)))
    assert list(response.first_token_ids) == expected.outputs[0].token_ids
    assert (response.request_id, response.num_prompt_tokens, response.num_cached_tokens,
            response.num_computed_tokens) == ("c1", 19, 0, 19)
    assert not response.HasField("transfer")
    (logprob,) = response.first_token_logprobs
    assert logprob.sampled.token_id == response.first_token_ids[0] and logprob.sampled.rank == 1
    assert [t.rank for t in logprob.top] == [1, 2] and logprob.top[0].logprob == pytest.approx(logprob.sampled.logprob)
    # The same prompt again: the worker's own prefix cache serves 4 of the 5 blocks.
    again = await prefill_response(prefill.stub.Prefill(p.PrefillRequest(request_id="c2", prompt_token_ids=PROMPT, sampling=greedy(4))))
    assert (again.num_cached_tokens, again.num_computed_tokens) == (16, 3)
    assert prefill.backend.counters.num_computed_tokens == 22
    await wait_pool_full(prefill.stub)


async def test_bad_prefills_are_refused(prefill):
    handle = c.TransferHandle(transport=c.TRANSPORT_KIND_TCP, address="127.0.0.1:9", transfer_id="t",
                              block_ids=[1, 2, 3, 4, 5])
    wrong_layout = c.TransferHandle()
    wrong_layout.CopyFrom(handle)
    wrong_layout.layout.CopyFrom(c.KVLayout(model_id="other", dtype=c.DTYPE_FLOAT32, block_size=4, num_layers=2,
                                            num_kv_heads=2, head_dim=16))
    short = c.TransferHandle()
    short.CopyFrom(handle)
    del short.block_ids[4:]
    expired = c.TransferHandle()
    expired.CopyFrom(handle)
    expired.deadline.FromSeconds(int(time.time()) - 1)
    cases = [
        (p.PrefillRequest(request_id="n", prompt_token_ids=PROMPT, sampling=greedy(4, n=2000)), "INVALID_ARGUMENT", "sampling.n"),
        (p.PrefillRequest(request_id="v", prompt_token_ids=[10**6]), "INVALID_ARGUMENT", "prompt"),
        (p.PrefillRequest(request_id="l", prompt_token_ids=PROMPT, destination=wrong_layout), "FAILED_PRECONDITION", "destination.layout.model_id"),
        (p.PrefillRequest(request_id="s", prompt_token_ids=PROMPT, destination=short), "INVALID_ARGUMENT", "destination.block_ids"),
        (p.PrefillRequest(request_id="e", prompt_token_ids=PROMPT, destination=expired), "DEADLINE_EXCEEDED", "expired"),
        (p.PrefillRequest(request_id="u", prompt_token_ids=PROMPT, destination=handle), "UNAVAILABLE", "cannot reach"),
    ]
    for request, code, text in cases:
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            await prefill_response(prefill.stub.Prefill(request))
        assert raised.value.code() == getattr(grpc.StatusCode, code) and text in raised.value.details(), (
            raised.value.details())
    await wait_pool_full(prefill.stub)


async def test_missed_transfer_deadline_frees_blocks_on_both_ends(prefill, checkpoint):
    decode = await start_decode(checkpoint, transfer_timeout_s=0.3)
    try:
        handle = (await decode.stub.Admit(d.AdmitRequest(
            request_id="slow", prompt_token_ids=PROMPT, sampling=greedy(4), gateway_id=GATEWAY))).handle
        await asyncio.sleep(0.4)
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            await prefill_response(prefill.stub.Prefill(p.PrefillRequest(request_id="slow", prompt_token_ids=PROMPT, destination=handle)))
        assert raised.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        await wait_pool_full(decode.stub)
        await wait_pool_full(prefill.stub)
    finally:
        await decode.close()


async def test_cancelled_prefill_releases_its_blocks(prefill):
    # A receiver that accepts the KV but never confirms: the prefill waits in the transfer.
    silent = await asyncio.start_server(lambda reader, writer: reader.read(-1), "127.0.0.1", 0)
    port = silent.sockets[0].getsockname()[1]
    handle = c.TransferHandle(transport=c.TRANSPORT_KIND_TCP, address=f"127.0.0.1:{port}", transfer_id="t",
                              block_ids=[1, 2, 3, 4, 5])
    call = prefill.stub.Prefill(p.PrefillRequest(request_id="x", prompt_token_ids=PROMPT, destination=handle))
    deadline = time.monotonic() + 5
    while (await prefill.stub.GetLoad(c.GetLoadRequest())).load.num_free_blocks == 64:
        assert time.monotonic() < deadline
        await asyncio.sleep(0.01)  # until the prompt's KV is held for the send
    load = (await prefill.stub.GetLoad(c.GetLoadRequest())).load
    assert (load.num_running, load.num_queued_prompt_tokens) == (1, 19)
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await prefill_response(call)
    await wait_pool_full(prefill.stub)
    silent.close()
