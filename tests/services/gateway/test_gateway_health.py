"""The gateway's health says whether it can route a request: gRPC health turns NOT_SERVING and
HTTP /ready 503 (with Retry-After) once no worker can take one, and back when one can; /health
stays a liveness probe. Requests refused meanwhile say when to retry."""

from __future__ import annotations

import asyncio

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from cleave.client import GatewayClient
from cleave.rpc import RETRY_AFTER_KEY, aio_channel
from services.gateway.__main__ import SERVICE_NAME
from services.gateway.readiness import Routability, unroutable_reason
from tests.services.gateway.stack import Stack, start_stack

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
WAIT_S = 5.0


async def wait_for_health(stack: Stack, want: int, service: str = "") -> int:
    """Watch the gateway's health until it reports `want` (or WAIT_S passed); the last status."""
    status = health_pb2.HealthCheckResponse.UNKNOWN
    async with aio_channel(stack.gateway_address) as channel:
        watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service=service))
        try:
            async with asyncio.timeout(WAIT_S):
                async for response in watch:
                    status = response.status
                    if status == want:
                        break
        except TimeoutError:
            pass
        finally:
            watch.cancel()
    return status


def _server(stack: Stack, address: str):  # type: ignore[no-untyped-def]
    return next(server for server in stack.servers if server.address == address)


def _base_url(stack: Stack) -> str:
    return stack.http_url.removesuffix("/v1")


@pytest.fixture
async def one_decoder(model_dir):
    """Colocated: the gateway's only worker is one decode worker."""
    stack = await start_stack(model_dir, "colocated", num_decode=1, health_interval_s=0.1)
    yield stack
    await stack.close()


async def test_no_decode_worker_is_not_serving_then_serving_again(one_decoder):
    stack = one_decoder
    assert stack.router is not None
    (decode,) = stack.router.pool.of_role("decode")
    assert await wait_for_health(stack, SERVING) == SERVING
    async with httpx.AsyncClient(base_url=_base_url(stack)) as http:
        assert (await http.get("/ready")).json() == {"status": "ok"}

        await _server(stack, decode.address).set_ready(False)  # the worker drains: out of rotation
        assert await wait_for_health(stack, NOT_SERVING) == NOT_SERVING
        assert await wait_for_health(stack, NOT_SERVING, SERVICE_NAME) == NOT_SERVING
        ready = await http.get("/ready")
        assert (ready.status_code, ready.headers.get("Retry-After")) == (503, "1")
        assert ready.json()["status"] == "unavailable" and "decode worker" in ready.json()["reason"]
        assert (await http.get("/health")).status_code == 200  # alive: a restart would not help

        async with GatewayClient(stack.gateway_address) as client:
            with pytest.raises(grpc.aio.AioRpcError) as raised:
                await client.complete("hi", max_tokens=2)
        assert raised.value.code() == grpc.StatusCode.UNAVAILABLE
        assert (RETRY_AFTER_KEY, "1000") in tuple(raised.value.trailing_metadata() or ())
        chat = await http.post("/v1/chat/completions",
                               json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
        assert (chat.status_code, chat.headers.get("Retry-After")) == (503, "1")
        assert "decode worker" in chat.json()["error"]["message"]

        await _server(stack, decode.address).set_ready(True)
        assert await wait_for_health(stack, SERVING) == SERVING
        assert await wait_for_health(stack, SERVING, SERVICE_NAME) == SERVING
        assert (await http.get("/ready")).status_code == 200


async def test_stopped_decode_worker_makes_the_gateway_not_serving(one_decoder):
    stack = one_decoder
    assert stack.router is not None
    (decode,) = stack.router.pool.of_role("decode")
    assert await wait_for_health(stack, SERVING) == SERVING
    await _server(stack, decode.address).drain(0)  # stops at once: its Attach stream breaks
    assert await wait_for_health(stack, NOT_SERVING) == NOT_SERVING
    async with httpx.AsyncClient(base_url=_base_url(stack)) as http:
        ready = await http.get("/ready")
    assert (ready.status_code, ready.headers.get("Retry-After")) == (503, "1")


async def wait_until(condition, what: str) -> None:  # type: ignore[no-untyped-def]
    """Poll `condition()` until it holds (the router's health checks run every 0.1 s)."""
    try:
        async with asyncio.timeout(60):  # a guard against a hang, not a wait
            while not condition():
                await asyncio.sleep(0.05)
    except TimeoutError:
        pytest.fail(f"never happened: {what}")


async def test_disaggregated_gateway_without_prefill_worker_prefills_on_the_decode_worker(model_dir):
    """A prefill worker out of rotation leaves the gateway SERVING: requests prefill on the
    decode worker meanwhile (the same greedy tokens) and go back to the prefill worker when
    it returns."""
    stack = await start_stack(model_dir, "disaggregated", num_decode=1, health_interval_s=0.1)
    try:
        assert stack.router is not None
        (prefill,) = stack.router.pool.of_role("prefill")
        prefill_server, (prefill_backend,) = _server(stack, prefill.address), stack.prefill
        assert await wait_for_health(stack, SERVING) == SERVING
        async with GatewayClient(stack.gateway_address) as client:
            remote = await client.complete("1+2=", max_tokens=6, temperature=0.0, ignore_eos=True)
            assert prefill_backend.counters.num_prefills == 1
            await prefill_server.set_ready(False)
            await wait_until(lambda: not stack.router.pool.of_role("prefill"), "the prefill worker left the rotation")
            local = await client.complete("1+2=", max_tokens=6, temperature=0.0, ignore_eos=True)
            assert local.samples[0].token_ids == remote.samples[0].token_ids
            assert prefill_backend.counters.num_prefills == 1  # prefilled on the decode worker
            async with httpx.AsyncClient(base_url=_base_url(stack)) as http:
                assert (await http.get("/ready")).status_code == 200
            assert await wait_for_health(stack, SERVING) == SERVING
            await prefill_server.set_ready(True)
            await wait_until(lambda: bool(stack.router.pool.of_role("prefill")), "the prefill worker is back")
            await client.complete("1+2=", max_tokens=6, temperature=0.0, ignore_eos=True)
            assert prefill_backend.counters.num_prefills == 2
    finally:
        await stack.close()


@pytest.mark.parametrize(
    ("mode", "num_prefill", "num_decode", "missing"),
    [
        ("disaggregated", 1, 1, None),
        ("disaggregated", 0, 1, None),  # prefills on the decode worker meanwhile
        ("disaggregated", 1, 0, "decode worker"),
        ("conditional", 0, 1, None),  # prefills on the decode worker when no prefill worker is left
        ("conditional", 1, 0, "decode worker"),
        ("colocated", 0, 1, None),
        ("colocated", 0, 0, "decode worker"),
    ],
)
def test_unroutable_reason_names_the_missing_role(mode, num_prefill, num_decode, missing):
    reason = unroutable_reason(mode, num_prefill, num_decode)
    assert (reason is None) == (missing is None)
    assert missing is None or missing in reason


async def test_routability_tells_watchers_each_change_once():
    reason: list[str | None] = ["no decode worker"]
    routability = Routability(lambda: reason[0])
    told: list[bool] = []

    async def record(ready: bool) -> None:
        told.append(ready)

    routability.watch(record)
    await routability.update()
    await routability.update()
    reason[0] = None
    await routability.update()
    await routability.update()
    reason[0] = "no prefill worker"
    await routability.update()
    assert told == [False, True, False]
    assert (routability.is_ready, routability.reason) == (False, "no prefill worker")
