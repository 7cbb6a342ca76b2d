"""The four services as separate processes over TCP: 50 concurrent streams, greedy tokens equal
to the in-process engine's, kvstore reuse of a repeated prompt, and every KV block freed."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from cleave.client import GatewayClient
from cleave.client.gateway import collect
from cleave.engine.llm import LLM
from cleave.generation.sampling_params import SamplingParams
from cleave.proto.cleave.v1 import (
    common_pb2,
    decode_pb2_grpc,
    gateway_pb2,
    kvstore_pb2,
    kvstore_pb2_grpc,
    prefill_pb2_grpc,
)
from cleave.rpc import aio_channel
from tests.e2e.conftest import NUM_KV_BLOCKS

WORDS = ("The quick brown fox jumps over the lazy dog while the serving system streams tokens "
         "back to every user as fast as the decode worker can produce them").split()
NUM_REQUESTS = 50
MAX_TOKENS = 8


def prompts() -> list[str]:
    # 40 distinct prompts plus 10 repeats; every prompt is longer than one KV block
    distinct = [" ".join(WORDS[i % 7:] + WORDS[: i % 7]) + f" request {i}" for i in range(40)]
    return distinct + distinct[:10]


def request(prompt: str) -> gateway_pb2.GenerateRequest:
    return gateway_pb2.GenerateRequest(
        text=prompt,
        sampling=common_pb2.SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0),
        stream=gateway_pb2.StreamOptions(include_token_ids=True),
    )


async def _decode_loads(stack) -> list[common_pb2.WorkerLoad]:
    loads = []
    for child in stack.children:
        if child.name.startswith("decode"):
            async with aio_channel(child.address, internal_token=stack.internal_token) as channel:
                response = await decode_pb2_grpc.DecodeStub(channel).GetLoad(common_pb2.GetLoadRequest())
                loads.append(response.load)
    return loads


async def _kvstore_stats(stack) -> kvstore_pb2.StatsResponse:
    kvstore = next(child for child in stack.children if child.name == "kvstore")
    async with aio_channel(kvstore.address, internal_token=stack.internal_token) as channel:
        return await kvstore_pb2_grpc.KVStoreStub(channel).Stats(kvstore_pb2.StatsRequest())


@pytest.mark.timeout(600)
async def test_fifty_concurrent_streams_match_the_engine(process_stack, e2e_model):
    texts = prompts()
    reference = LLM(e2e_model, device="cpu", dtype="float32",
                    num_blocks=NUM_KV_BLOCKS, enforce_eager=True)
    expected = reference.generate(texts[:40], SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))
    async with GatewayClient(process_stack.gateway_address) as client:
        results = await asyncio.gather(*(collect(client.stream(request(p))) for p in texts[:40]))
        # the repeats go after the originals finished, so their prefix is stored by then
        repeats = await asyncio.gather(*(collect(client.stream(request(p))) for p in texts[40:]))
        loads = await _decode_loads(process_stack)
        stats = await _kvstore_stats(process_stack)
    for result, engine_output in zip(results + repeats, expected + expected[:10]):
        assert result.samples[0].token_ids == engine_output.outputs[0].token_ids
        assert result.samples[0].finish_reason in ("stop", "length")
    assert all(load.num_free_blocks == load.num_total_blocks for load in loads), loads
    assert all(load.num_running == 0 for load in loads)
    if process_stack.spec.mode == "disaggregated":
        assert stats.bytes_stored > 0  # prefixes that repeated went to the store
        assert all(r.usage.cached_prompt_tokens > 0 for r in repeats)


async def test_cancelled_streams_free_their_blocks(process_stack):
    async with GatewayClient(process_stack.gateway_address) as client:
        calls = [client.generate(f"cancel me {i}", max_tokens=200, ignore_eos=True) for i in range(5)]
        for call in calls:
            await anext(aiter(call))
            call.cancel()
        for call in calls:
            with pytest.raises((asyncio.CancelledError, grpc.aio.AioRpcError, StopAsyncIteration)):
                await anext(aiter(call))
        for _ in range(50):
            loads = await _decode_loads(process_stack)
            if all(load.num_free_blocks == load.num_total_blocks for load in loads):
                break
            await asyncio.sleep(0.1)
    assert all(load.num_free_blocks == load.num_total_blocks and load.num_running == 0 for load in loads), loads



def _internal_call(child, channel):  # type: ignore[no-untyped-def]
    """One call on a stack child that only other services of the stack may make."""
    if child.name == "kvstore":
        return kvstore_pb2_grpc.KVStoreStub(channel).Stats(kvstore_pb2.StatsRequest())
    stub_class = decode_pb2_grpc.DecodeStub if child.name.startswith("decode") else prefill_pb2_grpc.PrefillStub
    return stub_class(channel).GetLoad(common_pb2.GetLoadRequest())


async def test_workers_and_kvstore_refuse_callers_without_the_stacks_token(process_stack):
    internal = [child for child in process_stack.children if not child.name.startswith("gateway")]
    assert {child.name for child in internal} >= {"kvstore", "decode-0"}
    for child in internal:
        for token in (None, "guess"):
            async with aio_channel(child.address, internal_token=token) as channel:
                with pytest.raises(grpc.aio.AioRpcError) as raised:
                    await _internal_call(child, channel)
                assert raised.value.code() == grpc.StatusCode.UNAUTHENTICATED, (child.name, token)
        async with aio_channel(child.address, internal_token=process_stack.internal_token) as channel:
            await _internal_call(child, channel)


async def test_a_cache_salt_shares_cached_prefixes_only_within_its_salt(process_stack):
    """What a caller can learn of another's prompt from the prefix cache (the cached tokens
    a response reports, its time to first token) stops at the salt: a prompt cached under
    one salt is a hit for that salt only, through gRPC and the openai client alike."""
    import openai

    prompt = "Salted: " + " ".join(reversed(WORDS * 2))  # no other test's prompt starts so

    def salted(salt: str) -> gateway_pb2.GenerateRequest:
        message = request(prompt)
        message.sampling.cache_salt = salt
        return message

    async with GatewayClient(process_stack.gateway_address) as client:
        first = await collect(client.stream(salted("tenant-a")))
        again = await collect(client.stream(salted("tenant-a")))
        other = await collect(client.stream(salted("tenant-b")))
        unsalted = await collect(client.stream(request(prompt)))
    assert first.usage.cached_prompt_tokens == 0
    assert again.usage.cached_prompt_tokens > 0
    assert other.usage.cached_prompt_tokens == 0 and unsalted.usage.cached_prompt_tokens == 0
    tokens = {tuple(result.samples[0].token_ids) for result in (first, again, other, unsalted)}
    assert len(tokens) == 1  # the salt changes what is cached, never the output

    http = openai.AsyncOpenAI(base_url=process_stack.http_url, api_key="unused", max_retries=0)
    async with http:
        model = (await http.models.list()).data[0].id

        def complete(salt: str | None):
            extra = {"cache_salt": salt} if salt is not None else {}
            return http.completions.create(model=model, prompt=prompt + " http",
                                           max_tokens=2, temperature=0, extra_body=extra)

        http_first = await complete("tenant-c")
        http_again = await complete("tenant-c")
        http_other = await complete("tenant-a")
        with pytest.raises(openai.BadRequestError, match="cache_salt"):
            await complete("")
    assert http_first.usage.prompt_tokens_details.cached_tokens == 0
    assert http_again.usage.prompt_tokens_details.cached_tokens > 0
    assert http_other.usage.prompt_tokens_details.cached_tokens == 0
