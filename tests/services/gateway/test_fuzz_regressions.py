"""The exact inputs the HTTP and gRPC fuzzers (`test_http_fuzz`, `test_grpc_fuzz`) found
answering 5xx / UNKNOWN / INTERNAL, each now a 400 / INVALID_ARGUMENT naming the field.

Nothing here reaches a worker (their addresses answer nothing): every input is refused
while the gateway validates it.
"""

from __future__ import annotations

import json

import grpc
import httpx
import pytest

from cleave.config import ModelConfig
from cleave.proto.cleave.v1 import common_pb2, gateway_pb2
from cleave.rpc import aio_channel, serve
from cleave.rpc.auth import api_key_auth
from cleave.rpc.errors import error_detail
from services.gateway.__main__ import registration
from services.gateway.http_api import OpenAIApi, bound_port, start_http
from services.gateway.model import ServedModel
from services.gateway.router import GatewayOptions, RoutingBackend
from services.gateway.servicer import GatewayServicer
from tests.services.gateway.proto_strategies import with_invalid_utf8
from tests.services.gateway.raw_http import raw_exchange

UNREACHABLE = "127.0.0.1:9"  # discard port: nothing answers
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
USER = {"role": "user", "content": "hi"}
API_KEY = "fuzz-key"


@pytest.fixture
async def gateway(model_dir):
    """(HTTP client, gRPC channel) of a gateway whose workers never answer."""
    model = ServedModel(ModelConfig(source=str(model_dir), served_name="tiny", max_context_length=256))
    backend = RoutingBackend(model, [UNREACHABLE], [UNREACHABLE], GatewayOptions(mode="disaggregated"))
    runner = await start_http(OpenAIApi(backend, [model.config], str, served_model=model), "127.0.0.1:0")
    server = None
    try:
        server = await serve([registration(GatewayServicer(backend, [model.config]))], "127.0.0.1:0",
                             handle_signals=False, auth=api_key_auth(API_KEY))
        await server.set_ready()
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{bound_port(runner)}", timeout=10) as client, \
                aio_channel(server.address) as channel:
            yield client, channel
    finally:
        if server is not None:
            await server.drain(0)
        await runner.cleanup()
        await backend.shutdown()


# (path, body, param): once 500 "internal server error" (protobuf's bool field took the int,
# and overflowed converting a huge one)
HTTP_FOUND = [
    (COMPLETIONS, {"prompt": "Hi", "max_tokens": 2, "ignore_eos": 2**63}, "ignore_eos"),
    (COMPLETIONS, {"prompt": "Hi", "max_tokens": 2, "skip_special_tokens": -(10**30)}, "skip_special_tokens"),
    (CHAT, {"messages": [USER], "max_tokens": 2, "stream": True, "ignore_eos": 2**64}, "ignore_eos"),
    (CHAT, {"messages": [USER], "max_tokens": 2, "skip_special_tokens": 10**30}, "skip_special_tokens"),
    # a number where a boolean belongs was silently taken as true
    (COMPLETIONS, {"prompt": "Hi", "ignore_eos": 1}, "ignore_eos"),
]


@pytest.mark.parametrize(("path", "body", "param"), HTTP_FOUND, ids=[str(i) for i in range(len(HTTP_FOUND))])
async def test_found_http_input_is_a_400_naming_the_field(gateway, path, body, param):
    client, _ = gateway
    response = await client.post(path, content=json.dumps(body), headers={"Content-Type": "application/json"})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["param"], error["type"]) == (param, "invalid_request_error")
    assert error["message"].startswith(f"{param}: must be true or false")


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT, "/tokenize", "/detokenize"])
@pytest.mark.parametrize("encoding", ["gzip", "deflate"])
async def test_a_body_that_does_not_decode_as_its_content_encoding_is_a_400(gateway, path, encoding):
    # once 500: aiohttp's RequestPayloadError escaped read_json
    client, _ = gateway
    async with httpx.AsyncClient(base_url=client.base_url, timeout=10,
                                 limits=httpx.Limits(max_keepalive_connections=0)) as fresh:
        response = await fresh.post(path, content=b"garbage",
                                    headers={"Content-Type": "application/json", "Content-Encoding": encoding})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "body"
    assert error["message"] == f"body: does not decode as its Content-Encoding {encoding!r}"


async def _raw_http(port: int, request: bytes) -> bytes:
    """The status line the server answers to `request`, sent byte for byte (httpx will not send
    header values that are not ASCII)."""
    return await raw_exchange(port, request, lambda reader: reader.readline())


def _request(method: bytes, path: bytes, header: bytes, value: bytes, body: bytes = b"") -> bytes:
    return (method + b" " + path + b" HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
            + b"Content-Type: application/json\r\nContent-Length: " + str(len(body)).encode() + b"\r\n"
            + header + b": " + value + b"\r\n\r\n" + body)


@pytest.fixture
async def keyed_http(model_dir):
    """The port of an HTTP API that asks for API_KEY (its workers never answer)."""
    model = ServedModel(ModelConfig(source=str(model_dir), served_name="tiny", max_context_length=256))
    backend = RoutingBackend(model, [UNREACHABLE], [UNREACHABLE], GatewayOptions(mode="disaggregated"))
    runner = await start_http(OpenAIApi(backend, [model.config], str, api_keys=API_KEY), "127.0.0.1:0")
    try:
        yield bound_port(runner)
    finally:
        await runner.cleanup()
        await backend.shutdown()


@pytest.mark.parametrize("value", [b"\xff\xfe", b"Bearer \xff", b"Bearer " + API_KEY.encode() + b"\xed\xa0\x80"])
async def test_an_authorization_header_that_is_not_utf8_is_a_401(keyed_http, value):
    # once 500: the key comparison encoded the header's lone surrogates
    status = await _raw_http(keyed_http, _request(b"POST", b"/v1/completions", b"Authorization", value, b"{}"))
    assert status.startswith(b"HTTP/1.1 401 "), status


@pytest.mark.parametrize(("method", "path"), [(b"POST", b"/v1/completions"), (b"POST", b"/tokenize"),
                                              (b"GET", b"/ready"), (b"GET", b"/v1/models")])
@pytest.mark.parametrize("value", [b"\xff\xfe", b"100-continue\xff"])
async def test_an_expect_header_that_is_not_utf8_is_a_417(gateway, method, path, value):
    # once 500: aiohttp's own 417 echoed the header and could not encode it
    client, _ = gateway
    port = int(str(client.base_url).rsplit(":", 1)[1].strip("/"))
    status = await _raw_http(port, _request(method, path, b"Expect", value))
    assert status.startswith(b"HTTP/1.1 417 "), status


async def test_expect_100_continue_still_gets_its_interim_answer(gateway):
    client, _ = gateway
    port = int(str(client.base_url).rsplit(":", 1)[1].strip("/"))
    status = await _raw_http(port, _request(b"POST", b"/tokenize", b"Expect", b"100-continue", b'{"prompt": "hi"}'))
    assert status.startswith(b"HTTP/1.1 100 "), status


def _raw(channel, method: str, response_class):  # type: ignore[no-untyped-def]
    """A call that sends bytes as they are (no client-side serialization)."""
    return channel.unary_unary(f"/cleave.v1.Gateway/{method}", request_serializer=lambda data: data,
                               response_deserializer=response_class.FromString)


# (method, bytes): once UNKNOWN "Unexpected DecodeError" from grpc's deserializer
GRPC_FOUND = [
    ("Generate", with_invalid_utf8(gateway_pb2.GenerateRequest(text="hi"), "text", b"\xff")),
    ("Generate", with_invalid_utf8(gateway_pb2.GenerateRequest(text="hi"), "model", b"\xc0\x80")),
    ("Generate", with_invalid_utf8(gateway_pb2.GenerateRequest(text="hi"), "request_id", b"\xed\xa0\x80")),
    ("Generate", b"\xff\xff\xff"),
    ("Abort", with_invalid_utf8(common_pb2.AbortRequest(), "request_id", b"a\xfe")),
    ("Abort", b"\x08" + b"\xff" * 11),
    ("ListModels", b"\x0a\xff"),
]
_RESPONSES = {"Generate": gateway_pb2.GenerateResponse, "Abort": common_pb2.AbortResponse,
              "ListModels": gateway_pb2.ListModelsResponse}


@pytest.mark.parametrize(("method", "wire"), GRPC_FOUND, ids=[str(i) for i in range(len(GRPC_FOUND))])
async def test_found_undecodable_grpc_request_is_invalid_argument(gateway, method, wire):
    _, channel = gateway
    if method == "Generate":
        call = channel.unary_stream(f"/cleave.v1.Gateway/{method}", request_serializer=lambda data: data,
                                    response_deserializer=gateway_pb2.GenerateResponse.FromString)
    else:
        call = _raw(channel, method, _RESPONSES[method])
    metadata = (("authorization", f"Bearer {API_KEY}"),)
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        result = call(wire, metadata=metadata, timeout=10)
        if method == "Generate":
            async for _ in result:
                pass
        else:
            await result
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT, raised.value.details()
    assert error_detail(raised.value).field == "request"
    assert "does not parse" in raised.value.details()


async def test_an_undecodable_request_without_the_api_key_is_unauthenticated(gateway):
    _, channel = gateway
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await _raw(channel, "ListModels", gateway_pb2.ListModelsResponse)(b"\x0a\xff", timeout=10)
    assert raised.value.code() == grpc.StatusCode.UNAUTHENTICATED
