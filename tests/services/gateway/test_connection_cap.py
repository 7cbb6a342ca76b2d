"""Connection caps: the HTTP API answers a connection past its cap 503 (OpenAI's shape, with
Retry-After) and takes new ones again once one closes; a gRPC server closes one past its cap;
the caps' defaults follow the open-file limit, which a service raises at start-up."""

from __future__ import annotations

import asyncio
import resource

import grpc
import httpx
import openai
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from cleave.config import ModelConfig, RpcConfig, gateway_config, worker_config
from cleave.generation.outputs import FinishReason
from cleave.rpc import aio_channel, serve
from cleave.rpc.connection_limits import FD_RESERVE, MIN_CONNECTIONS, connection_cap, raise_open_file_limit
from cleave.rpc.types import Usage
from services.gateway.backend import GenerateChunk, SampleOutput
from services.gateway.http_api import OpenAIApi, bound_port, start_http

HEALTH = b"GET /health HTTP/1.1\r\nHost: gateway\r\n\r\n"


class OneChunkBackend:
    async def generate(self, spec):  # type: ignore[no-untyped-def]
        yield GenerateChunk(samples=(SampleOutput(index=0, text="ok", token_ids=(5,),
                                                  finish_reason=FinishReason.LENGTH),))
        yield GenerateChunk(usage=Usage(prompt_tokens=1, completion_tokens=1))


async def _held_connection(port: int) -> asyncio.StreamWriter:
    """A keep-alive connection that has had one answer (so the server counts it), left open."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(HEALTH)
    await writer.drain()
    assert (await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)).startswith(b"HTTP/1.1 200")
    return writer


async def _until_served(client: httpx.AsyncClient, deadline_s: float = 30.0) -> httpx.Response:
    """GET /health on fresh connections until one is not refused (the server sees a closed
    connection a moment after the client closed it)."""
    loop = asyncio.get_running_loop()
    end = loop.time() + deadline_s
    while True:
        response = await client.get("/health", headers={"Connection": "close"})
        if response.status_code != 503 or loop.time() > end:
            return response
        await asyncio.sleep(0.02)


async def test_an_http_connection_past_the_cap_is_answered_503_until_one_closes():
    api = OpenAIApi(OneChunkBackend(), [ModelConfig(source="tiny")], str)
    runner = await start_http(api, "127.0.0.1:0", max_connections=2)
    port = bound_port(runner)
    held: list[asyncio.StreamWriter] = []
    try:
        held = [await _held_connection(port), await _held_connection(port)]
        async with openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0) as client:
            with pytest.raises(openai.APIStatusError) as refused:
                await client.completions.create(model="tiny", prompt="hi", max_tokens=1)
        assert refused.value.status_code == 503
        assert refused.value.response.headers["retry-after"] == "1"
        error = refused.value.response.json()["error"]
        assert error["message"] == ("the server is at its limit of 2 open HTTP connections; retry later, "
                                    "or reuse a connection (keep-alive)")
        # a connection past the cap is answered and half-closed without reading its request
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            answer = await asyncio.wait_for(reader.read(), 10)  # up to the server's FIN
        finally:
            writer.close()
        assert answer.startswith(b"HTTP/1.1 503 Service Unavailable\r\n") and b"Connection: close" in answer
        held.pop().close()
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=10) as fresh:
            assert (await _until_served(fresh)).status_code == 200
            completion = await openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none",
                                                  max_retries=0, http_client=fresh).completions.create(
                model="tiny", prompt="hi", max_tokens=1)
        assert completion.choices[0].text == "ok"
    finally:
        for writer in held:
            writer.close()
        await runner.cleanup()


async def test_a_grpc_connection_past_the_cap_is_closed():
    server = await serve([], "127.0.0.1:0", RpcConfig(max_connections=1), handle_signals=False)
    await server.set_ready()
    request = health_pb2.HealthCheckRequest(service="")
    # each channel its own subchannel pool: its own TCP connection
    options = [("grpc.use_local_subchannel_pool", 1)]
    try:
        async with grpc.aio.insecure_channel(server.address, options=options) as first:
            assert (await health_pb2_grpc.HealthStub(first).Check(request, timeout=10)).status == \
                health_pb2.HealthCheckResponse.SERVING
            async with grpc.aio.insecure_channel(server.address, options=options) as second:
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await health_pb2_grpc.HealthStub(second).Check(request, timeout=10)
                assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
            # the first connection is served as before
            assert (await health_pb2_grpc.HealthStub(first).Check(request, timeout=10)).status == \
                health_pb2.HealthCheckResponse.SERVING
    finally:
        await server.drain(0)


def test_the_default_cap_is_half_the_open_file_limit_past_the_reserve(monkeypatch):
    monkeypatch.setattr(resource, "getrlimit", lambda which: (1024, 4096))
    assert connection_cap(None) == (1024 - FD_RESERVE) // 2 == 384
    assert connection_cap(7) == 7
    monkeypatch.setattr(resource, "getrlimit", lambda which: (280, 4096))
    assert connection_cap(None) == MIN_CONNECTIONS


def test_the_open_file_limit_is_raised_towards_the_hard_limit_never_lowered(monkeypatch):
    limits = {"soft": 1024, "hard": 4096}
    monkeypatch.setattr(resource, "getrlimit", lambda which: (limits["soft"], limits["hard"]))

    def setrlimit(which, values):  # type: ignore[no-untyped-def]
        limits["soft"], limits["hard"] = values

    monkeypatch.setattr(resource, "setrlimit", setrlimit)
    assert raise_open_file_limit(target=65536) == 4096 and limits == {"soft": 4096, "hard": 4096}
    assert raise_open_file_limit(target=2048) == 4096 and limits["soft"] == 4096


def test_max_connections_is_a_flag_of_every_service(tmp_path):
    config = gateway_config(["--model", str(tmp_path), "--max-connections", "64"], {})
    assert config.service.rpc.max_connections == 64
    assert worker_config("decode", ["--model", str(tmp_path)], {}).service.rpc.max_connections is None
    with pytest.raises(SystemExit, match="--max-connections must be >= 1, got 0"):
        worker_config("prefill", ["--model", str(tmp_path), "--max-connections", "0"], {})
