"""Draining (what SIGTERM starts): a service stops taking new work at once, finishes every
request it admitted within its grace period, then stops. The gateway routes around a draining
worker without calling it lost, so nothing migrates and no admitted request is cut."""

from __future__ import annotations

import asyncio

import aiohttp
import grpc
import pytest
import structlog

from cleave.client import GatewayClient
from cleave.client.gateway import collect
from cleave.generation.sampling_params import SamplingParams
from cleave.proto.cleave.v1 import common_pb2 as c
from cleave.proto.cleave.v1 import decode_pb2 as d
from cleave.proto.cleave.v1 import decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc
from cleave.proto.cleave.v1 import gateway_pb2 as g
from cleave.rpc import RETRY_AFTER_KEY, Server, aio_channel
from cleave.rpc.prefill_call import prefill_response
from tests.services.gateway.helpers import reference_llm
from tests.services.gateway.stack import INTERNAL_TOKEN, Stack, start_stack

MAX_TOKENS = 160
GRACE_S = 30.0  # far more than the requests need: the drain must end when they do
IDS = g.StreamOptions(include_token_ids=True)
PROMPTS = [f"Request {index}: the quick brown fox jumps over the lazy dog" for index in range(4)]


def server_of(stack: Stack, backend: object) -> Server:
    """The server of a started backend (`stack.servers` starts with the kvstore's)."""
    return stack.servers[stack.backends.index(backend) + 1]


def expected_tokens(model_dir, prompts: list[str]) -> list[list[int]]:  # type: ignore[no-untyped-def]
    outputs = reference_llm(model_dir).generate(
        prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True))
    return [output.outputs[0].token_ids for output in outputs]


async def _counted(stream, progress: list[int], index: int, flowing: asyncio.Event, num: int):  # type: ignore[no-untyped-def]
    async for response in stream:
        progress[index] += sum(len(sample.token_ids) for sample in response.samples)
        if all(count >= 2 for count in progress[:num]):  # the second token comes from the decode worker
            flowing.set()
        yield response


def start_streams(client: GatewayClient, prompts: list[str]) -> tuple[list[asyncio.Future], asyncio.Event]:
    """Stream every prompt; the event is set once each is decoding (has two tokens)."""
    progress = [0] * len(prompts)
    flowing = asyncio.Event()
    tasks = [
        asyncio.ensure_future(collect(_counted(
            client.generate(prompt, max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True,
                            request_id=f"drain-{index}", stream=IDS),
            progress, index, flowing, len(prompts))))
        for index, prompt in enumerate(prompts)
    ]
    return tasks, flowing


async def wait_for(condition, timeout_s: float = 10.0) -> None:  # type: ignore[no-untyped-def]
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)


def assert_complete(results, expected: list[list[int]], logs: list[dict]) -> None:  # type: ignore[no-untyped-def]
    for result, tokens in zip(results, expected):
        (sample,) = result.samples
        assert sample.token_ids == tokens, result.request_id
        assert sample.finish_reason == "length"
    assert not [entry for entry in logs if entry["event"] in ("request migrated", "worker lost: health checks unanswered")]


@pytest.mark.parametrize("mode", ["disaggregated", "colocated"])
async def test_a_draining_decode_worker_finishes_its_requests_and_takes_no_new_ones(model_dir, mode):
    stack = await start_stack(model_dir, mode, num_decode=2, health_interval_s=0.1)
    try:
        assert stack.router is not None
        expected = expected_tokens(model_dir, PROMPTS + ["after the drain began"])
        async with GatewayClient(stack.gateway_address) as client:
            with structlog.testing.capture_logs() as logs:
                tasks, flowing = start_streams(client, PROMPTS)
                await asyncio.wait_for(flowing.wait(), 30)
                victim = max(stack.decode, key=lambda backend: backend.load().num_running)
                assert victim.load().num_running > 0  # admitted work is running there
                server = server_of(stack, victim)
                server.drain_work_of(victim)
                drain = asyncio.ensure_future(server.drain(GRACE_S))
                drained_logs: list[dict] = []
                drain.add_done_callback(lambda _: drained_logs.extend(logs))  # it is lost once stopped
                async with aio_channel(server.address, internal_token=INTERNAL_TOKEN) as channel:
                    with pytest.raises(grpc.aio.AioRpcError) as refused:
                        await decode_pb2_grpc.DecodeStub(channel).Start(d.StartRequest(
                            request_id="new", prefill_locally=True, prompt_token_ids=[5, 6, 7],
                            sampling=c.SamplingParams(max_tokens=2), gateway_id="someone"))
                assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
                assert "draining" in refused.value.details()
                assert dict(refused.value.trailing_metadata())[RETRY_AFTER_KEY] == "1000"
                handle = next(w for w in stack.router.pool.workers if w.address == server.address)
                await wait_for(lambda: not handle.healthy)
                assert handle.failed_checks == 0  # out of rotation: it answered NOT_SERVING, it is not lost
                late = await client.complete("after the drain began", max_tokens=MAX_TOKENS, temperature=0.0,
                                             ignore_eos=True, stream=IDS)
                results = await asyncio.wait_for(asyncio.gather(*tasks), 60)
                await asyncio.wait_for(drain, GRACE_S)
        assert_complete([*results, late], expected, drained_logs)
        assert victim.load().num_free_blocks == victim.load().num_total_blocks
    finally:
        await stack.close()


async def test_a_draining_prefill_worker_finishes_its_prefills_and_refuses_new_ones(model_dir, monkeypatch):
    stack = await start_stack(model_dir, "disaggregated", num_decode=1, health_interval_s=0.1)
    try:
        (prefill,) = stack.prefill
        release = asyncio.Event()
        real_fetch = prefill._fetch_prefix

        async def held_fetch(request_id, prompt, cache_salt):  # type: ignore[no-untyped-def]
            await release.wait()  # every prompt is admitted here and held until the drain began
            return await real_fetch(request_id, prompt, cache_salt)

        monkeypatch.setattr(prefill, "_fetch_prefix", held_fetch)
        expected = expected_tokens(model_dir, PROMPTS)
        async with GatewayClient(stack.gateway_address) as client:
            with structlog.testing.capture_logs() as logs:
                tasks, _ = start_streams(client, PROMPTS)
                await wait_for(lambda: len(prefill._in_flight) == len(PROMPTS))
                server = server_of(stack, prefill)
                server.drain_work_of(prefill)
                drain = asyncio.ensure_future(server.drain(GRACE_S))
                drained_logs: list[dict] = []
                drain.add_done_callback(lambda _: drained_logs.extend(logs))  # it is lost once stopped
                async with aio_channel(server.address, internal_token=INTERNAL_TOKEN) as channel:
                    with pytest.raises(grpc.aio.AioRpcError) as refused:
                        await prefill_response(prefill_pb2_grpc.PrefillStub(channel).Prefill(
                            prefill_pb2.PrefillRequest(request_id="new", prompt_token_ids=[5, 6, 7])))
                assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
                assert "draining" in refused.value.details()
                assert not drain.done()  # it waits for the admitted prefills
                release.set()
                results = await asyncio.wait_for(asyncio.gather(*tasks), 60)
                await asyncio.wait_for(drain, GRACE_S)
        assert_complete(results, expected, drained_logs)
    finally:
        await stack.close()


async def test_a_draining_gateway_finishes_its_streams_and_refuses_new_requests(model_dir):
    stack = await start_stack(model_dir, "colocated", num_decode=1, health_interval_s=0.1)
    try:
        router = stack.router
        assert router is not None
        expected = expected_tokens(model_dir, PROMPTS)
        server = stack.servers[-1]
        server.drain_work_of(router)
        base_url = stack.http_url.removesuffix("/v1")
        async with GatewayClient(stack.gateway_address) as client, aiohttp.ClientSession() as http:
            with structlog.testing.capture_logs() as logs:
                tasks, flowing = start_streams(client, PROMPTS)
                await asyncio.wait_for(flowing.wait(), 30)
                drain = asyncio.ensure_future(server.drain(GRACE_S))
                await wait_for(lambda: router.gate.is_draining)
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await client.complete("too late", max_tokens=4)
                assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
                assert dict(refused.value.trailing_metadata())[RETRY_AFTER_KEY] == "1000"
                async with http.get(f"{base_url}/ready") as ready:
                    assert ready.status == 503 and ready.headers["Retry-After"] == "1"
                    assert "draining" in (await ready.json())["reason"]
                body = {"model": "tiny", "messages": [{"role": "user", "content": "too late"}], "max_tokens": 4}
                async with http.post(f"{stack.http_url}/chat/completions", json=body) as late:
                    assert late.status == 503 and late.headers["Retry-After"] == "1"
                assert not drain.done()  # the admitted streams are still running
                results = await asyncio.wait_for(asyncio.gather(*tasks), 60)
                await asyncio.wait_for(drain, GRACE_S)
                drained_logs = list(logs)
        assert_complete(results, expected, drained_logs)
    finally:
        await stack.close()
