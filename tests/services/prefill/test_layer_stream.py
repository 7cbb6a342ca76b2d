"""The prefill worker ships a prompt's KV layer by layer during its final chunk's forward
(`layer_streaming="on"` makes the CPU transports take that path): the receiver gets the
same bytes as a send after the step, the decode continues with the in-process LLM's greedy
tokens, and a send that fails mid-layer frees both ends."""

from __future__ import annotations

import asyncio
import random
import threading

import grpc
import pytest
import torch

from cleave.engine.llm import LLM
from cleave.generation.sampling_params import SamplingParams
from cleave.proto.cleave.v1 import decode_pb2 as d
from cleave.proto.cleave.v1 import prefill_pb2 as p
from cleave.transfer.block_copy import copy_blocks
from cleave.transfer.memory import MemoryEndpoint, MemoryTransferClient
from cleave.rpc.prefill_call import prefill_response
from services.prefill.backend import PrefillSpec
from services.prefill.engine_backend import AUTO_LAYER_STREAM_MIN_TOKENS, EnginePrefillBackend
from tests.worker.cluster import (
    ENGINE_ARGS, GATEWAY, MODEL_ID, AttachReader, BrokenBulkConnection, check_torn_transfer, engine_config, greedy,
    start_decode, start_prefill, wait_pool_full,
)

MAX_TOKENS = 8
PROMPTS = [[random.Random(seed).randrange(5, 500) for _ in range(17 + 6 * seed)] for seed in range(3)]


@pytest.fixture(scope="module")
def reference(checkpoint):
    llm = LLM(checkpoint, **ENGINE_ARGS)
    outputs = llm.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True))
    return [output.outputs[0].token_ids for output in outputs]


# ---- in-memory transport: byte-identical blocks -------------------------------------------


async def memory_prefill(checkpoint, mode: str, prompt: list[int]):
    """Prefill `prompt` into a fresh receiving cache over the in-memory transport; returns
    (received cache, destination ids, the runs of layers copied, backend counters)."""
    backend = EnginePrefillBackend(engine_config(checkpoint), worker_id="p", model_id=MODEL_ID, layer_streaming=mode)
    await backend.start()
    try:
        endpoint = MemoryEndpoint(torch.zeros_like(backend.engine.kv_cache))
        await endpoint.start()
        runs: list[range] = []

        def copy(src, dst, src_index, dst_index, layers):  # type: ignore[no-untyped-def]
            runs.append(layers)
            copy_blocks(src, dst, src_index, dst_index, layers)

        backend.transfers = MemoryTransferClient(endpoint, copy=copy)
        num_blocks = backend.engine.handoff.num_blocks_for(len(prompt))
        dst_ids = random.Random(7).sample(range(1, 60), num_blocks)
        pending = endpoint.expect("t", dst_ids, timeout_s=10)
        spec = PrefillSpec("r", tuple(prompt), SamplingParams(temperature=0.0, max_tokens=1), pending.handle)
        result = await backend.prefill(spec)
        await pending.wait()
        assert result.transfer is not None and result.transfer.num_blocks == num_blocks
        claimed = backend.layer_streams.num_claimed if backend.layer_streams else 0
        return endpoint.kv_cache, dst_ids, runs, claimed
    finally:
        await backend.shutdown()


async def test_layer_streamed_kv_is_byte_identical_to_a_send_after_the_step(checkpoint):
    prompt = PROMPTS[2]
    streamed, streamed_ids, streamed_runs, claimed = await memory_prefill(checkpoint, "on", prompt)
    after, after_ids, after_runs, after_claimed = await memory_prefill(checkpoint, "off", prompt)
    num_layers = streamed.shape[0]
    assert (claimed, after_claimed) == (1, 0)
    assert after_runs == [range(num_layers)]  # one run of every layer, after the step
    # every layer once, in order, in runs issued while the forward went on
    assert [layer for run in streamed_runs for layer in run] == list(range(num_layers))
    received = streamed[:, :, streamed_ids]
    assert torch.count_nonzero(received) > 0
    assert torch.equal(received.view(torch.uint8), after[:, :, after_ids].view(torch.uint8))


# ---- TCP between real workers: tokens, and failures ---------------------------------------


def prefill_request(request_id: str, prompt: list[int], decode_address: str) -> p.PrefillRequest:
    return p.PrefillRequest(request_id=request_id, prompt_token_ids=prompt, sampling=greedy(MAX_TOKENS),
                            decode=p.DecodeTarget(address=decode_address, gateway_id=GATEWAY))


async def prefill_after_admit(prefill, request: p.PrefillRequest):
    """Start the Prefill call with the prefill engine held between steps until the decode
    worker's reservation came back and its stream is offered, so the final chunk's step
    finds the destination known (the race the worker resolves either way, made one way)."""
    backend = prefill.backend
    gate, held = threading.Event(), asyncio.Event()
    loop = asyncio.get_running_loop()

    def hold(engine) -> None:  # type: ignore[no-untyped-def]
        loop.call_soon_threadsafe(held.set)
        gate.wait(10)

    holding = asyncio.ensure_future(backend.async_engine.call(hold))
    await held.wait()
    call = asyncio.ensure_future(prefill_response(prefill.stub.Prefill(request)))
    try:
        for _ in range(500):
            if request.request_id in backend.layer_streams or call.done():
                break
            await asyncio.sleep(0.01)
    finally:
        gate.set()
        await holding
    return await call


async def test_layer_streamed_prefill_over_tcp_decodes_the_llm_tokens(checkpoint, reference):
    decode, prefill = await start_decode(checkpoint), await start_prefill(checkpoint)
    prefill.backend.layer_streaming = "on"
    try:
        reader = AttachReader(decode.stub)
        # driven by the prefill worker: the reservation arrives while the engine is held
        driven = await prefill_after_admit(prefill, prefill_request("s0", PROMPTS[0], decode.server.address))
        assert prefill.backend.layer_streams.num_claimed == 1
        # driven by the gateway: the destination is in the request
        admitted = await decode.stub.Admit(d.AdmitRequest(
            request_id="s1", prompt_token_ids=PROMPTS[1], sampling=greedy(MAX_TOKENS), gateway_id=GATEWAY))
        given = await prefill_response(prefill.stub.Prefill(p.PrefillRequest(
            request_id="s1", prompt_token_ids=PROMPTS[1], sampling=greedy(MAX_TOKENS), destination=admitted.handle)))
        assert prefill.backend.layer_streams.num_claimed == 2
        await decode.stub.Start(d.StartRequest(request_id="s1", first_token_ids=given.first_token_ids,
                                               gateway_id=GATEWAY, first_tokens_delivered=True))
        await reader.wait_finished(["s0", "s1"])
        assert [*driven.first_token_ids, *reader.tokens("s0")] == reference[0]
        assert [*given.first_token_ids, *reader.tokens("s1")] == reference[1]
        await wait_pool_full(decode.stub)
        await wait_pool_full(prefill.stub)
        await reader.cancel()
    finally:
        await prefill.close()
        await decode.close()


async def test_a_layer_stream_that_fails_mid_layer_frees_both_ends(checkpoint, monkeypatch):
    decode, prefill = await start_decode(checkpoint), await start_prefill(checkpoint)
    prefill.backend.layer_streaming = "on"
    broken = BrokenBulkConnection(monkeypatch, num_chunks=1)
    try:
        reader = AttachReader(decode.stub)
        with pytest.raises(grpc.aio.AioRpcError) as failed:
            await prefill_after_admit(prefill, prefill_request("torn", PROMPTS[0], decode.server.address))
        assert prefill.backend.layer_streams.num_claimed == 1
        assert broken.writes == 2  # layer 0 went, layer 1 broke
        await check_torn_transfer(failed.value, decode, prefill, reader, "torn")
        await reader.cancel()
    finally:
        await prefill.close()
        await decode.close()


async def test_auto_streams_only_long_prompts(checkpoint):
    """"auto" leaves a short prompt's KV to the send after the step (its launch-bound forward
    would lose more to the per-layer callbacks than streaming hides) and opens a stream for a
    long one."""
    backend = EnginePrefillBackend(engine_config(checkpoint), worker_id="p", model_id=MODEL_ID, layer_streaming="auto")
    backend.layer_streams = object()  # type: ignore[assignment]  # as after start(), without an engine
    destination = object()
    assert backend._open_layer_stream("short", destination, AUTO_LAYER_STREAM_MIN_TOKENS - 1) is None  # type: ignore[arg-type]
    opening = backend._open_layer_stream("long", destination, AUTO_LAYER_STREAM_MIN_TOKENS)  # type: ignore[arg-type]
    assert opening is not None
    opening.cancel()
    await asyncio.gather(opening, return_exceptions=True)
