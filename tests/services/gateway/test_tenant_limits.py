"""`--max-requests-per-key` and `--max-samples-per-key`: a key with as many requests, or samples,
running as the cap is refused at once (429 with Retry-After over HTTP, RESOURCE_EXHAUSTED over
gRPC) while other keys are served; its slot comes back when a request ends, however it ends. A
request asking for more samples than the cap by itself is refused as invalid, naming its field."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import grpc
import httpx
import openai
import pytest

from cleave.api_keys import ApiKeys, key_tag
from cleave.client import GatewayClient
from cleave.config import ModelConfig
from cleave.generation.outputs import FinishReason
from cleave.generation.sampling_params import SamplingParams
from cleave.proto.cleave.v1 import gateway_pb2
from cleave.rpc import serve
from cleave.rpc.auth import api_key_auth
from cleave.rpc.types import Usage
from cleave.scaling.strategies import Strategy
from services.gateway.__main__ import registration
from services.gateway.backend import GenerateChunk, GenerateSpec, SampleOutput, Scaling, num_samples
from services.gateway.client_errors import ClientSafeBackend
from services.gateway.http_api import OpenAIApi, bound_port, start_http
from services.gateway.servicer import GatewayServicer
from services.gateway.tenant_limits import TenantBusy, TenantLimits
from tests.services.gateway.test_metered import spec  # a spec with no tenant

KEYS = ApiKeys(("sk-busy", "sk-calm"))
MODEL = ModelConfig(source="tiny")


class HeldBackend:
    """Streams one chunk of every sample, then holds every request until `go` is set."""

    def __init__(self) -> None:
        self.go = asyncio.Event()
        self.started = 0

    async def start(self) -> None: ...

    async def shutdown(self) -> None: ...

    async def abort(self, request_id: str, sample_index: int | None = None) -> bool:
        return False

    async def generate(self, spec):  # type: ignore[no-untyped-def]
        self.started += 1
        indices = range(num_samples(spec))
        yield GenerateChunk(samples=tuple(SampleOutput(index=index, text="a", token_ids=(1,)) for index in indices))
        await self.go.wait()
        yield GenerateChunk(samples=tuple(SampleOutput(index=index, text="b", token_ids=(2,),
                                                       finish_reason=FinishReason.STOP) for index in indices),
                            usage=Usage(prompt_tokens=1, completion_tokens=2 * len(indices)))


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
    with pytest.raises(ValueError):
        TenantLimits(held, max_requests=-1, max_samples=4)
    with pytest.raises(ValueError):
        TenantLimits(held, max_samples=-1)


def with_samples(request_id: str, n: int = 1, majority_of: int = 0) -> GenerateSpec:
    """A spec with no tenant asking for `n` samples, or `majority_of` under majority vote."""
    spec_n = replace(spec(request_id), sampling=SamplingParams(n=n))
    if not majority_of:
        return spec_n
    return replace(spec_n, scaling=Scaling(strategy=Strategy.MAJORITY_VOTE, num_samples=majority_of))


async def test_over_http_a_key_whose_samples_would_pass_the_cap_gets_429_while_another_key_is_served():
    held = HeldBackend()
    limits = TenantLimits(held, max_samples=4)
    api = OpenAIApi(ClientSafeBackend(limits), [MODEL], str, api_keys=KEYS)
    runner = await start_http(api, "127.0.0.1:0")
    base_url = f"http://127.0.0.1:{bound_port(runner)}"
    busy_tag, calm_tag = key_tag("sk-busy"), key_tag("sk-calm")
    try:
        busy = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="sk-busy", max_retries=0)
        calm = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="sk-calm", max_retries=0)
        async with busy, calm:
            first = asyncio.ensure_future(busy.completions.create(model="tiny", prompt="hi", n=3))
            await until(lambda: limits.running_samples(busy_tag) == 3)
            with pytest.raises(openai.RateLimitError) as refused:  # 3 + 2 > 4, though 2 alone fits
                await busy.completions.create(model="tiny", prompt="again", n=2)
            assert refused.value.response.headers["Retry-After"] == "1"
            assert "--max-samples-per-key" in refused.value.message and "3 samples" in refused.value.message
            beside = asyncio.ensure_future(calm.completions.create(model="tiny", prompt="x", n=2))
            await until(lambda: limits.running_samples(calm_tag) == 2)  # the other key is counted on its own
            assert held.started == 2
            held.go.set()
            assert [choice.text for choice in (await first).choices] == ["ab"] * 3
            assert len((await beside).choices) == 2
            assert limits.running_samples(busy_tag) == limits.running_samples(calm_tag) == 0
            again = await busy.completions.create(model="tiny", prompt="again", n=2)  # the samples came back
            assert [choice.text for choice in again.choices] == ["ab"] * 2
    finally:
        await runner.cleanup()


async def test_a_request_asking_for_more_samples_than_the_cap_is_invalid_naming_its_field():
    held = HeldBackend()
    limits = TenantLimits(held, max_samples=4)
    api = OpenAIApi(ClientSafeBackend(limits), [MODEL], str, api_keys=KEYS)
    runner = await start_http(api, "127.0.0.1:0")
    server = await serve([registration(GatewayServicer(ClientSafeBackend(limits), [MODEL], KEYS))], "127.0.0.1:0",
                         handle_signals=False, auth=api_key_auth(KEYS))
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{bound_port(runner)}", timeout=10,
                                     headers={"Authorization": "Bearer sk-calm"}) as http:
            refused = await http.post("/v1/completions", json={"prompt": "hi", "n": 5})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "n"
        assert "--max-samples-per-key 4" in refused.json()["error"]["message"]
        async with GatewayClient(server.address, api_key="sk-calm") as client:
            with pytest.raises(grpc.aio.AioRpcError) as raised:
                await client.complete("hi", max_tokens=2, n=5)
            assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert raised.value.details().startswith("sampling.n: 5 samples")
            voting = gateway_pb2.TestTimeScaling(strategy=gateway_pb2.TestTimeScaling.STRATEGY_MAJORITY_VOTE,
                                                 num_samples=8)
            with pytest.raises(grpc.aio.AioRpcError) as raised:  # n is 1: the strategy's samples are what count
                await client.complete("hi", max_tokens=2, scaling=voting)
            assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert raised.value.details().startswith("scaling.num_samples: 8 samples")
        assert held.started == 0 and limits.running_samples(key_tag("sk-calm")) == 0
    finally:
        await server.drain(0)
        await runner.cleanup()


async def test_both_caps_hold_together_and_a_failed_request_gives_its_samples_back():
    held = HeldBackend()
    limits = TenantLimits(held, max_requests=2, max_samples=5)
    first = limits.generate(with_samples("r0", majority_of=3))  # n is 1, but the vote runs 3
    await anext(first)
    assert limits.running_samples() == 3
    with pytest.raises(TenantBusy, match="--max-samples-per-key"):
        await anext(limits.generate(with_samples("r1", n=3)))
    second = limits.generate(with_samples("r1", n=1))
    await anext(second)
    with pytest.raises(TenantBusy, match="--max-requests-per-key"):  # its samples fit (4 + 1), a third request not
        await anext(limits.generate(with_samples("r2", n=1)))
    assert (limits.running(), limits.running_samples()) == (2, 4)
    with pytest.raises(RuntimeError):  # the request fails mid-stream: its samples come back
        await first.athrow(RuntimeError("worker lost"))
    assert (limits.running(), limits.running_samples()) == (1, 1)
    third = limits.generate(with_samples("r3", n=3))
    await anext(third)
    await second.aclose(), await third.aclose()
    assert (limits.running(), limits.running_samples()) == (0, 0)


class StaggeredBackend:
    """Streams the request's samples ending one after another, each end when `step` is set."""

    def __init__(self) -> None:
        self.step = asyncio.Event()

    async def generate(self, spec):  # type: ignore[no-untyped-def]
        for index in range(num_samples(spec)):
            await self.step.wait()
            self.step.clear()
            yield GenerateChunk(samples=(SampleOutput(index=index, text="a", token_ids=(1,),
                                                      finish_reason=FinishReason.STOP),))


async def test_a_streamed_sample_that_ends_gives_its_place_back_before_its_request_ends():
    staggered = StaggeredBackend()
    limits = TenantLimits(staggered, max_samples=4)  # type: ignore[arg-type]
    long = limits.generate(with_samples("r0", n=3))
    staggered.step.set()
    assert (await anext(long)).samples[0].finish_reason is FinishReason.STOP
    assert limits.running_samples() == 2  # sample 0 ended; 1 and 2 still run
    with pytest.raises(TenantBusy, match="--max-samples-per-key"):  # 2 + 3 > 4
        await anext(limits.generate(with_samples("r1", n=3)))
    other = limits.generate(with_samples("r1", n=2))  # 2 + 2 fits only because sample 0 gave its place back
    staggered.step.set()
    await anext(other)
    assert limits.running_samples() == 3
    await long.aclose(), await other.aclose()
    assert (limits.running(), limits.running_samples()) == (0, 0)  # never below: an ended sample counts once


async def test_each_prompt_of_a_completions_batch_counts_its_samples():
    held = HeldBackend()
    limits = TenantLimits(held, max_samples=4)
    api = OpenAIApi(ClientSafeBackend(limits), [MODEL], str, api_keys=KEYS)
    runner = await start_http(api, "127.0.0.1:0")
    busy_tag = key_tag("sk-busy")
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{bound_port(runner)}", timeout=10,
                                     headers={"Authorization": "Bearer sk-busy"}) as busy:
            batch = asyncio.ensure_future(busy.post("/v1/completions", json={"prompt": ["a", "b"], "n": 2}))
            await until(lambda: limits.running(busy_tag) == 2)
            assert limits.running_samples(busy_tag) == 4
            refused = await busy.post("/v1/completions", json={"prompt": "c"})
            assert refused.status_code == 429
            held.go.set()
            answer = await batch
            assert answer.status_code == 200 and len(answer.json()["choices"]) == 4
        assert limits.running_samples(busy_tag) == 0
    finally:
        await runner.cleanup()


async def test_a_completions_batch_that_could_never_fit_under_a_cap_is_a_400_naming_prompt():
    """Its prompts run at once: three prompts under a cap of two requests, or two prompts of
    n = 3 under a cap of four samples, would be refused with a Retry-After however long the
    client waited; they are the body's fault (400), and none of its prompts starts."""
    held = HeldBackend()
    held.go.set()
    cases = [(TenantLimits(held, max_requests=2), {"prompt": ["a", "b", "c"]}, "--max-requests-per-key 2"),
             (TenantLimits(held, max_samples=4), {"prompt": ["a", "b"], "n": 3}, "--max-samples-per-key 4")]
    for limits, body, flag in cases:
        runner = await start_http(OpenAIApi(ClientSafeBackend(limits), [MODEL], str, api_keys=KEYS), "127.0.0.1:0")
        try:
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{bound_port(runner)}", timeout=10,
                                         headers={"Authorization": "Bearer sk-busy"}) as busy:
                refused = await busy.post("/v1/completions", json=body)
                assert refused.status_code == 400, refused.text
                assert refused.json()["error"]["param"] == "prompt" and flag in refused.json()["error"]["message"]
                fits = await busy.post("/v1/completions", json={**body, "prompt": body["prompt"][:1]})
                assert fits.status_code == 200, fits.text
        finally:
            await runner.cleanup()
    assert held.started == 2  # the two bodies of one prompt; no prompt of a refused body started
