"""The gateway's API key (`--api-key`): every HTTP route but the probes and /metrics, and the
gRPC Gateway service, ask for `Bearer <key>`; /health, /ready, /metrics and gRPC health stay
open; without a key nothing is asked."""

from __future__ import annotations

import grpc
import httpx
import openai
import pytest
import pytest_asyncio
from grpc_health.v1 import health_pb2, health_pb2_grpc

from cleave.client import GatewayClient
from cleave.proto.cleave.v1 import gateway_pb2, gateway_pb2_grpc
from cleave.rpc import aio_channel
from tests.services.gateway.stack import start_stack

pytestmark = pytest.mark.asyncio(loop_scope="module")
API_KEY = "sk-test-key"


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def stack(model_dir):
    running = await start_stack(model_dir, "colocated", api_key=API_KEY)
    yield running
    await running.close()


def client(stack, api_key: str) -> openai.AsyncOpenAI:  # type: ignore[no-untyped-def]
    return stack.openai(api_key)  # closed with the stack


async def test_the_right_key_is_served(stack):
    models = await client(stack, API_KEY).models.list()
    assert [m.id for m in models.data] == ["tiny"]
    response = await client(stack, API_KEY).completions.create(model="tiny", prompt="Hello", max_tokens=3)
    assert response.usage.completion_tokens == 3


async def test_a_wrong_key_is_401_in_openais_error_shape(stack):
    with pytest.raises(openai.AuthenticationError) as raised:
        await client(stack, "sk-wrong").completions.create(model="tiny", prompt="Hello", max_tokens=3)
    assert raised.value.status_code == 401
    error = raised.value.body
    assert error["type"] == "invalid_request_error" and error["code"] == "invalid_api_key"
    assert "wrong API key" in error["message"]


@pytest.mark.parametrize("path", ["/v1/models", "/v1/chat/completions", "/v1/completions", "/v1/responses",
                                  "/tokenize", "/detokenize"])
async def test_no_key_is_401_on_every_api_route_and_the_probes_stay_open(stack, path):
    base = stack.http_url.removesuffix("/v1")
    async with httpx.AsyncClient(base_url=base) as http:
        method = http.get if path == "/v1/models" else http.post
        kwargs = {} if path == "/v1/models" else {"json": {"model": "tiny", "prompt": "x", "tokens": [1]}}
        response = await method(path, **kwargs)
        assert response.status_code == 401 and response.headers["WWW-Authenticate"] == "Bearer"
        assert "no API key" in response.json()["error"]["message"]
        for open_path in ("/health", "/ready", "/metrics"):
            assert (await http.get(open_path)).status_code == 200, open_path


async def test_the_tokenizer_routes_answer_with_the_key(stack):
    base = stack.http_url.removesuffix("/v1")
    async with httpx.AsyncClient(base_url=base, headers={"Authorization": f"Bearer {API_KEY}"}) as http:
        tokens = (await http.post("/tokenize", json={"model": "tiny", "prompt": "Hello"})).json()["tokens"]
        text = (await http.post("/detokenize", json={"model": "tiny", "tokens": tokens})).json()["prompt"]
    assert tokens and text.endswith("Hello")


async def test_grpc_generate_asks_for_the_key(stack):
    request = gateway_pb2.GenerateRequest(text="Hello")
    request.sampling.max_tokens = 3
    for api_key in (None, "sk-wrong"):
        async with aio_channel(stack.gateway_address, api_key=api_key) as channel:
            with pytest.raises(grpc.aio.AioRpcError) as raised:
                async for _ in gateway_pb2_grpc.GatewayStub(channel).Generate(request):
                    pass
            assert raised.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert "authorization: Bearer <key>" in raised.value.details()
            health = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
            assert health.status == health_pb2.HealthCheckResponse.SERVING
    async with GatewayClient(stack.gateway_address, api_key=API_KEY) as gateway:
        responses = [response async for response in gateway.generate("Hello", max_tokens=3)]
    assert responses[-1].usage.completion_tokens == 3
