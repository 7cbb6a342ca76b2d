"""`--max-requests-per-key`: a key with as many requests running as the cap is refused at once
(429 with Retry-After over HTTP, RESOURCE_EXHAUSTED over gRPC) while other keys are served;
its slot comes back when a request ends, however it ends."""

from __future__ import annotations

import asyncio

import grpc
import httpx
import openai
import pytest

from cleave.api_keys import ApiKeys, key_tag
from cleave.client import GatewayClient
from cleave.config import ModelConfig
from cleave.generation.outputs import FinishReason
from cleave.rpc import serve
from cleave.rpc.auth import api_key_auth
from cleave.rpc.types import Usage
from services.gateway.__main__ import registration
from services.gateway.backend import GenerateChunk, SampleOutput
from services.gateway.client_errors import ClientSafeBackend
from services.gateway.http_api import OpenAIApi, bound_port, start_http
from services.gateway.servicer import GatewayServicer
from services.gateway.tenant_limits import TenantBusy, TenantLimits
from tests.services.gateway.test_metered import spec  # a spec with no tenant

KEYS = ApiKeys(("sk-busy", "sk-calm"))
MODEL = ModelConfig(source="tiny")


class HeldBackend:
    """Streams one chunk, then holds every request until `go` is set."""

    def __init__(self) -> None:
        self.go = asyncio.Event()
        self.started = 0

    async def start(self) -> None: ...

    async def shutdown(self) -> None: ...

    async def abort(self, request_id: str, sample_index: int | None = None) -> bool:
        return False

    async def generate(self, spec):  # type: ignore[no-untyped-def]
        self.started += 1
        yield GenerateChunk(samples=(SampleOutput(index=0, text="a", token_ids=(1,)),))
        await self.go.wait()
        yield GenerateChunk(samples=(SampleOutput(index=0, text="b", token_ids=(2,), finish_reason=FinishReason.STOP),),
                            usage=Usage(prompt_tokens=1, completion_tokens=2))


async def until(condition, timeout_s: float = 10.0) -> None:  # type: ignore[no-untyped-def]
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)


async def test_a_key_at_its_cap_gets_429_and_retry_after_while_another_key_is_served():
    held = HeldBackend()
    limits = TenantLimits(held, max_requests=1)
    api = OpenAIApi(ClientSafeBackend(limits), [MODEL], str, api_keys=KEYS)
    runner = await start_http(api, "127.0.0.1:0")
    base_url = f"http://127.0.0.1:{bound_port(runner)}"
    try:
        async with httpx.AsyncClient(base_url=base_url, timeout=10,
                                     headers={"Authorization": "Bearer sk-busy"}) as busy:
            async with busy.stream("POST", "/v1/completions", json={"prompt": "hi", "stream": True}) as stream:
                lines = stream.aiter_lines()
                assert (await anext(lines)).startswith("data: ")  # running, holding the key's one slot
                refused = await busy.post("/v1/completions", json={"prompt": "again"})
                assert refused.status_code == 429 and refused.headers["Retry-After"] == "1"
                assert "--max-requests-per-key" in refused.json()["error"]["message"]
                calm = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="sk-calm", max_retries=0)
                async with calm:
                    first = asyncio.ensure_future(calm.completions.create(model="tiny", prompt="x"))
                    await until(lambda: limits.running(key_tag("sk-calm")) == 1)  # served beside the busy key
                    with pytest.raises(openai.RateLimitError):  # now the calm key is at its own cap
                        await calm.completions.create(model="tiny", prompt="y")
                    held.go.set()
                    assert (await first).choices[0].text == "ab"
                rest = [line async for line in lines if line]
            assert rest[-1] == "data: [DONE]"
        assert limits.running(key_tag("sk-busy")) == limits.running(key_tag("sk-calm")) == 0
    finally:
        await runner.cleanup()


async def test_over_grpc_a_key_at_its_cap_is_resource_exhausted_and_a_cancelled_stream_frees_its_slot():
    held = HeldBackend()
    limits = TenantLimits(held, max_requests=1)
    server = await serve([registration(GatewayServicer(ClientSafeBackend(limits), [MODEL], KEYS))], "127.0.0.1:0",
                         handle_signals=False, auth=api_key_auth(KEYS))
    try:
        async with GatewayClient(server.address, api_key="sk-busy") as client:
            first = client.generate("hi", max_tokens=2)
            await anext(aiter(first))  # running
            with pytest.raises(grpc.aio.AioRpcError) as raised:
                await client.complete("again", max_tokens=2)
            assert raised.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert dict(raised.value.trailing_metadata())["retry-after-ms"] == "1000"
            first.cancel()
            await until(lambda: limits.running(key_tag("sk-busy")) == 0)  # the server sees the cancel a moment later
            held.go.set()
            assert (await client.complete("now", max_tokens=2)).samples[0].text == "ab"
    finally:
        await server.drain(0)


async def test_one_key_or_none_shares_one_cap_and_the_cap_must_be_positive():
    held = HeldBackend()
    limits = TenantLimits(held, max_requests=2)
    streams = [limits.generate(spec(f"r{index}")) for index in range(3)]
    await anext(streams[0]), await anext(streams[1])
    with pytest.raises(TenantBusy):
        await anext(streams[2])
    assert limits.running() == 2
    for stream in streams[:2]:
        await stream.aclose()
    assert limits.running() == 0
    with pytest.raises(ValueError):
        TenantLimits(held, max_requests=0)
