"""Bounded input at the gateway: body and message size limits (413 / RESOURCE_EXHAUSTED),
prompts refused by their UTF-8 size before the tokenizer runs, long prompts tokenized and
large bodies parsed off the event loop, a 400 naming the field for every malformed HTTP body,
and OpenAI-shaped answers, logged in one line, to requests the HTTP parser refuses.

The routing backend here has workers that never answer: every request is refused or
tokenized before it would need one.
"""

from __future__ import annotations

import asyncio
import gzip
import importlib
import json
import logging
import sys
import threading

import grpc
import httpx
import openai
import pytest
import structlog

from cleave.config import (
    DEFAULT_GATEWAY_MAX_MESSAGE_BYTES,
    DEFAULT_MAX_MESSAGE_BYTES,
    ModelConfig,
    RpcConfig,
    gateway_config,
    worker_config,
)
from cleave.generation.outputs import FinishReason
from cleave.generation.sampling_params import MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS
from cleave.proto.cleave.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from cleave.rpc import aio_channel, serve
from cleave.rpc.errors import error_detail
from cleave.rpc.types import Usage
from services.gateway.__main__ import registration
from services.gateway.backend import GenerateChunk, SampleOutput
from services.gateway.http_api import OpenAIApi, bound_port, start_http
from services.gateway.http_body import INLINE_PARSE_MAX_BYTES
from services.gateway.model import ServedModel
from services.gateway.router import INLINE_TOKENIZE_MAX_BYTES, GatewayOptions, RoutingBackend
from services.gateway.servicer import GatewayServicer
from tests.services.gateway.raw_http import raw_exchange
from tests.tracing.helpers import by_name, memory_tracing

MAX_MODEL_LEN = 256
MAX_REQUEST_BYTES = 256 * 1024
UNREACHABLE = "127.0.0.1:9"  # discard port: nothing answers


class CountingTokenizer:
    """Wraps the model's tokenizer call; `before_encode` runs in the calling thread first."""

    def __init__(self, model: ServedModel) -> None:
        self.encode = model.tokenizer.encode_without_gil
        self.calls = 0
        self.before_encode = lambda: None

    def __call__(self, text: str, add_special_tokens: bool = True) -> list[int]:
        self.calls += 1
        self.before_encode()
        return self.encode(text, add_special_tokens=add_special_tokens)


@pytest.fixture
async def gateway(model_dir, monkeypatch):
    """A routing backend (workers unreachable) behind the HTTP API and a gRPC server with
    small limits; yields (http client, grpc channel, tokenizer wrapper, spans)."""
    model = ServedModel(ModelConfig(source=str(model_dir), served_name="tiny", max_context_length=MAX_MODEL_LEN))
    tokenizer = CountingTokenizer(model)
    monkeypatch.setattr(model.tokenizer, "encode_without_gil", tokenizer)
    backend = RoutingBackend(model, [UNREACHABLE], [UNREACHABLE], GatewayOptions(mode="disaggregated"))
    tracing, spans = memory_tracing("cleave-gateway")
    api = OpenAIApi(backend, [model.config], str, tracing=tracing, max_request_bytes=MAX_REQUEST_BYTES)
    runner = await start_http(api, "127.0.0.1:0")
    server = await serve([registration(GatewayServicer(backend, [model.config]))], "127.0.0.1:0",
                         RpcConfig(max_message_bytes=MAX_REQUEST_BYTES), handle_signals=False)
    await server.set_ready()
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{bound_port(runner)}", timeout=10) as client, \
            aio_channel(server.address) as channel:
        yield client, channel, tokenizer, spans
    await server.drain(0)
    await runner.cleanup()
    await backend.shutdown()


# ---- size limits --------------------------------------------------------------------------


def test_the_gateway_receives_smaller_grpc_messages_than_workers():
    assert gateway_config([], {}).service.rpc.max_message_bytes == DEFAULT_GATEWAY_MAX_MESSAGE_BYTES
    assert worker_config("decode", [], {}).service.rpc.max_message_bytes == DEFAULT_MAX_MESSAGE_BYTES
    assert DEFAULT_GATEWAY_MAX_MESSAGE_BYTES < DEFAULT_MAX_MESSAGE_BYTES
    config = gateway_config(["--max-request-bytes", "1000", "--max-prompt-bytes", "500"], {})
    assert (config.max_request_bytes, config.max_prompt_bytes) == (1000, 500)


async def test_grpc_message_over_the_limit_is_resource_exhausted(gateway):
    _, channel, tokenizer, _ = gateway
    stub = gateway_pb2_grpc.GatewayStub(channel)
    request = gateway_pb2.GenerateRequest(text="x" * (MAX_REQUEST_BYTES + 1))
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        async for _ in stub.Generate(request):
            pass
    assert raised.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert str(MAX_REQUEST_BYTES) in raised.value.details()
    assert tokenizer.calls == 0


class GatedBackend:
    """Streams one chunk, then waits for `go` before the last one."""

    def __init__(self) -> None:
        self.go = asyncio.Event()

    async def generate(self, spec):  # type: ignore[no-untyped-def]
        yield GenerateChunk(samples=(SampleOutput(index=0, text="a", token_ids=(1,)),))
        await self.go.wait()
        yield GenerateChunk(samples=(SampleOutput(index=0, text="b", token_ids=(2,), finish_reason=FinishReason.STOP),),
                            usage=Usage(prompt_tokens=1, completion_tokens=2))


async def test_body_over_the_limit_is_413_while_a_stream_goes_on():
    backend = GatedBackend()
    api = OpenAIApi(backend, [ModelConfig(source="tiny")], str, max_request_bytes=MAX_REQUEST_BYTES)
    runner = await start_http(api, "127.0.0.1:0")
    base_url = f"http://127.0.0.1:{bound_port(runner)}"
    try:
        async with httpx.AsyncClient(base_url=base_url, timeout=10) as client:
            body = {"prompt": "hi", "max_tokens": 2, "stream": True}
            async with client.stream("POST", "/v1/completions", json=body) as stream:
                lines = stream.aiter_lines()
                assert (await anext(lines)).startswith("data: ")  # the first chunk arrived
                huge = {"prompt": "x" * (2 * MAX_REQUEST_BYTES)}
                response = await client.post("/v1/completions", json=huge)
                assert response.status_code == 413
                error = response.json()["error"]
                assert error["param"] == "body" and str(MAX_REQUEST_BYTES) in error["message"]

                async def chunked():  # no Content-Length: cut off by aiohttp's client_max_size
                    for _ in range(4):
                        yield b" " * (MAX_REQUEST_BYTES // 2)

                response = await client.post("/v1/completions", content=chunked())
                assert response.status_code == 413
                # its size unknown past the limit (once "the request body is more; ...")
                cut_off = (f"body: the request body is over {MAX_REQUEST_BYTES} bytes; this gateway accepts at "
                           f"most {MAX_REQUEST_BYTES} bytes (--max-request-bytes)")
                assert response.json()["error"]["message"] == cut_off
                bomb = gzip.compress(b" " * (4 * MAX_REQUEST_BYTES))  # small on the wire, cut off as it decodes
                response = await client.post("/v1/completions", content=bomb, headers={"Content-Encoding": "gzip"})
                assert response.status_code == 413 and response.json()["error"]["message"] == cut_off
                backend.go.set()
                rest = [line async for line in lines if line]
            assert rest[-1] == "data: [DONE]" and '"text": "b"' in rest[-2]
        # the real client sees the same 413
        async with openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0) as real:
            with pytest.raises(openai.APIStatusError) as raised:
                await real.completions.create(model="tiny", prompt="x" * (2 * MAX_REQUEST_BYTES))
        assert raised.value.status_code == 413
    finally:
        await runner.cleanup()


async def test_an_integer_too_long_to_convert_is_a_400_that_says_so():
    # json.loads' ValueError told the client to call sys.set_int_max_str_digits()
    api = OpenAIApi(GatedBackend(), [ModelConfig(source="tiny")], str)
    runner = await start_http(api, "127.0.0.1:0")
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{bound_port(runner)}", timeout=10) as client:
            response = await client.post("/v1/completions", content=b'{"prompt": "hi", "max_tokens": ' + b"9" * 5000
                                         + b"}", headers={"Content-Type": "application/json"})
    finally:
        await runner.cleanup()
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "body"
    assert error["message"] == f"body: holds an integer of more than {sys.get_int_max_str_digits()} digits"


async def _raw_post(port: int, head: str, body: bytes = b"") -> tuple[bytes, asyncio.StreamReader, asyncio.StreamWriter]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(head.encode() + body)
    await writer.drain()
    status = await asyncio.wait_for(reader.readline(), timeout=5)
    return status, reader, writer


async def test_expect_100_continue_over_the_limit_is_413_before_the_body():
    api = OpenAIApi(GatedBackend(), [ModelConfig(source="tiny")], str, max_request_bytes=MAX_REQUEST_BYTES)
    runner = await start_http(api, "127.0.0.1:0")
    port = bound_port(runner)
    try:
        head = ("POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                "Expect: 100-continue\r\nContent-Length: {}\r\n\r\n")
        status, reader, writer = await _raw_post(port, head.format(10 * MAX_REQUEST_BYTES))
        assert status.startswith(b"HTTP/1.1 413")  # answered without the body ever being sent
        writer.close()
        body = json.dumps({"prompt": "hi", "max_tokens": 1}).encode()
        status, reader, writer = await _raw_post(port, head.format(len(body)))
        assert status.startswith(b"HTTP/1.1 100")  # within the limit: go on
        writer.close()
    finally:
        await runner.cleanup()


async def _until_closed(port: int, sent: bytes) -> bytes:
    """Everything the gateway answers to `sent` until it closes the connection (at most 10 s)."""
    return await raw_exchange(port, sent, lambda reader: reader.read())


async def _answer(port: int, sent: bytes) -> tuple[bytes, bytes]:
    """(head, body) of the gateway's answer to `sent` (at most 10 s)."""

    async def head_and_body(reader: asyncio.StreamReader) -> tuple[bytes, bytes]:
        head = await reader.readuntil(b"\r\n\r\n")
        length = int(head.split(b"Content-Length: ")[1].split(b"\r\n")[0])
        return head, await reader.readexactly(length)

    return await raw_exchange(port, sent, head_and_body)


async def test_connections_that_never_send_a_whole_request_are_closed():
    """Idle, half a request line, headers without their end: each held a connection for an
    hour. A body that stops arriving held one (and a buffer of up to --max-request-bytes)
    for as long as the client liked; now it is a 408 that closes the connection (once
    aiohttp's lingering read of the rest ends)."""
    api = OpenAIApi(GatedBackend(), [ModelConfig(source="tiny")], str, idle_timeout_s=0.2, body_timeout_s=0.2)
    runner = await start_http(api, "127.0.0.1:0")
    port = bound_port(runner)
    try:
        for partial in (b"", b"POST /v1/compl", b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Slow: "):
            assert await _until_closed(port, partial) == b""
        head = "POST {} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n"
        for path in ("/v1/completions", "/v1/chat/completions", "/v1/responses"):
            status, body = await _answer(port, head.format(path).encode() + b'{"prompt": "a')
            assert status.startswith(b"HTTP/1.1 408 ") and b"Connection: close" in status, status
            error = json.loads(body)["error"]
            assert error["param"] == "body" and "0.2 s" in error["message"]
    finally:
        await runner.cleanup()


# ---- prompt size before tokenizing ----------------------------------------------------------


async def test_prompt_over_the_byte_bound_is_refused_without_tokenizing(gateway):
    client, channel, tokenizer, _ = gateway
    over = "é" * MAX_MODEL_LEN * 64  # well under the body limit, far over what 256 tokens can hold
    response = await client.post("/v1/completions", json={"prompt": over})
    assert response.status_code == 400 and response.json()["error"]["param"] == "prompt"
    assert "bytes" in response.json()["error"]["message"]
    response = await client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": over}]})
    assert response.status_code == 400 and response.json()["error"]["param"] == "messages"
    async with openai.AsyncOpenAI(base_url=str(client.base_url).rstrip("/") + "/v1", api_key="unused",
                                  max_retries=0) as real:
        with pytest.raises(openai.BadRequestError) as raised:
            await real.completions.create(model="tiny", prompt=over)
    assert raised.value.body["param"] == "prompt"
    stub = gateway_pb2_grpc.GatewayStub(channel)
    with pytest.raises(grpc.aio.AioRpcError) as raised_rpc:
        async for _ in stub.Generate(gateway_pb2.GenerateRequest(text=over)):
            pass
    assert raised_rpc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error_detail(raised_rpc.value).field == "text"
    assert tokenizer.calls == 0


async def test_long_prompt_tokenizes_in_a_thread_under_the_request_span(gateway):
    client, _, tokenizer, spans = gateway
    tokenizing, health_answered = threading.Event(), threading.Event()
    answered_while_tokenizing = []

    def hold_until_health_answers() -> None:
        # on the event loop this would block the health check below: the wait times out
        tokenizing.set()
        answered_while_tokenizing.append(health_answered.wait(timeout=5))

    tokenizer.before_encode = hold_until_health_answers
    prompt = "ab " * (INLINE_TOKENIZE_MAX_BYTES // 2)  # over the inline size, within the byte bound
    request = asyncio.create_task(client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1}))
    assert await asyncio.to_thread(tokenizing.wait, 5)
    assert (await client.get("/health")).status_code == 200
    health_answered.set()
    response = await request
    assert answered_while_tokenizing == [True]
    assert response.status_code in (400, 503)  # too long for the context, or no worker answers
    server = by_name(spans.get_finished_spans(), "POST /v1/completions")
    tokenize = by_name(spans.get_finished_spans(), "gateway.tokenize")
    assert tokenize.parent.span_id == server.context.span_id


# ---- malformed bodies -----------------------------------------------------------------------

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
USER = {"role": "user", "content": "hi"}


def _chat(**fields) -> bytes:  # type: ignore[no-untyped-def]
    return json.dumps({"messages": [USER], **fields}).encode()


def _message(**fields) -> bytes:  # type: ignore[no-untyped-def]
    return json.dumps({"messages": [{**USER, **fields}]}).encode()


MALFORMED = [
    (CHAT, b'{"messages": [', "body"),
    (CHAT, b"[1, 2]", "body"),
    (CHAT, b'"hello"', "body"),
    (CHAT, b"[" * 100_000 + b"]" * 100_000, "body"),
    (CHAT, b'{"messages": "\xff\xfe"}', "body"),
    (CHAT, _chat(model=5), "model"),
    (CHAT, _chat(model=["tiny"]), "model"),
    (CHAT, json.dumps({"messages": "hi"}).encode(), "messages"),
    (CHAT, _message(content=None), "messages[0].content"),
    (CHAT, _message(content=5), "messages[0].content"),
    (CHAT, _message(content=[{"type": "image_url", "image_url": {"url": "x"}}]), "messages[0].content[0]"),
    (CHAT, _message(content=[{"type": "text", "text": 5}]), "messages[0].content[0].text"),
    (CHAT, b'{"messages": [{"role": "user", "content": "a\\ud800b"}]}', "messages[0].content"),
    (CHAT, _message(name=["x"]), "messages[0].name"),
    (COMPLETIONS, b'{"prompt": "\\udfff"}', "prompt"),
    (CHAT, _chat(max_thinking_tokens=1e12), "max_thinking_tokens"),
    (CHAT, _chat(max_thinking_tokens=10**12), "max_thinking_tokens"),
    (CHAT, _chat(max_tokens=-1), "max_tokens"),
    (CHAT, _chat(max_tokens=1e30), "max_tokens"),
    (COMPLETIONS, json.dumps({"prompt": "hi", "max_tokens": 10**30}).encode(), "max_tokens"),
    (CHAT, _chat(temperature="hot"), "temperature"),
    (CHAT, b'{"messages": [{"role": "user", "content": "hi"}], "temperature": NaN}', "temperature"),
    (CHAT, _chat(seed=10**30), "seed"),
    (CHAT, _chat(stream="yes"), "stream"),
    (CHAT, _chat(stream=True, stream_options=5), "stream_options"),
    (CHAT, _chat(stream_options={"include_usage": True}), "stream_options"),  # only for a stream
    (COMPLETIONS, json.dumps({"prompt": "hi", "stream": True, "stream_options": {"include_usage": "yes"}}).encode(),
     "stream_options.include_usage"),
    (CHAT, _chat(reasoning_mode=["inline"]), "reasoning_mode"),
    (CHAT, _chat(stop=[1]), "stop[0]"),
    (CHAT, _chat(n=0), "n"),
    # finite here, infinite as the 32-bit float a worker receives
    (CHAT, _chat(temperature=1e300), "temperature"),
    (COMPLETIONS, json.dumps({"prompt": "hi", "repetition_penalty": 1e39}).encode(), "repetition_penalty"),
    # every stop string is searched for after every token
    (CHAT, _chat(stop=[f"stop {i}" for i in range(1000)]), "stop"),
    # and what could still become one is held back and searched again with each token
    (CHAT, _chat(stop=["x" * 5000]), "stop"),
    # more digits than int() converts
    (CHAT, _chat(logit_bias={"9" * 5000: 1}), "logit_bias"),
]


@pytest.mark.parametrize(("path", "body", "param"), MALFORMED, ids=[str(i) for i in range(len(MALFORMED))])
async def test_malformed_body_is_a_400_naming_the_field(gateway, path, body, param):
    client, _, tokenizer, _ = gateway
    response = await client.post(path, content=body, headers={"Content-Type": "application/json"})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["param"], error["type"]) == (param, "invalid_request_error")
    assert error["message"].startswith(f"{param}: ")
    assert tokenizer.calls == 0


@pytest.mark.parametrize(("field", "value", "path"), [
    ("max_tokens", 2**32 - 1, "sampling.max_tokens"),
    ("n", 2**32 - 1, "sampling.n"),
    ("logprobs", 2**32 - 1, "sampling.logprobs"),
    ("stop", [f"stop {i}" for i in range(1000)], "sampling.stop"),
    ("stop", ["x" * 5000], "sampling.stop"),
])
async def test_grpc_out_of_range_fields_are_invalid_argument(gateway, field, value, path):
    _, channel, _, _ = gateway
    stub = gateway_pb2_grpc.GatewayStub(channel)
    request = gateway_pb2.GenerateRequest(text="hi", sampling=common_pb2.SamplingParams(**{field: value}))
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        async for _ in stub.Generate(request):
            pass
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error_detail(raised.value).field == path


# ---- long lists are counted before they are read ---------------------------------------------
# A million empty chat turns (33 MB, within the body limit) were converted one by one on the event
# loop, holding every other client's stream for seconds, before the prompt was refused as too long
# once rendered. Each list below is too long and its first element is bad too: the field and the
# message named show that the list was counted first, and the per-element reader, wrapped, shows
# that no element was read.

RESPONSES = "/v1/responses"
EMPTY_TURN = {"role": "user", "content": ""}
COUNTED_FIRST = {
    "chat turns": (CHAT, {"messages": [{"role": "nobody"}] + [EMPTY_TURN] * MAX_MODEL_LEN},
                   "messages", f"holds {MAX_MODEL_LEN + 1} messages", "openai_request._chat_turn"),
    "earlier tool calls": (CHAT, {"messages": [{"role": "assistant", "tool_calls": [{}] * MAX_MODEL_LEN}, USER]},
                           "messages[0].tool_calls", f"holds {MAX_MODEL_LEN} tool calls",
                           "openai_request.assistant_tool_calls"),
    "responses items": (RESPONSES, {"input": [{"type": "bogus"}] + [EMPTY_TURN] * MAX_MODEL_LEN},
                        "input", f"holds {MAX_MODEL_LEN + 1} items", "responses_api.chat_role"),
    "prompt token ids": (COMPLETIONS, {"prompt": [-1] + [5] * MAX_MODEL_LEN}, "prompt",
                         f"has {MAX_MODEL_LEN + 1} tokens", None),
    "stop strings": (CHAT, {"messages": [USER], "stop": [""] + ["x"] * MAX_STOP_STRINGS}, "stop",
                     f"holds {MAX_STOP_STRINGS + 1} strings", None),
    "stop token ids": (CHAT, {"messages": [USER], "stop_token_ids": [-1] + [3] * MAX_STOP_TOKEN_IDS},
                       "stop_token_ids", f"holds {MAX_STOP_TOKEN_IDS + 1} token ids", None),
    "logit biases": (CHAT, {"messages": [USER], "logit_bias": {"5": "x", **{str(k): 1 for k in range(6, 6 + 1024)}}},
                     "logit_bias", "holds 1025 biased tokens", None),
}


@pytest.mark.parametrize(("path", "body", "param", "message", "reader"), COUNTED_FIRST.values(),
                         ids=COUNTED_FIRST.keys())
async def test_a_list_too_long_is_refused_before_its_elements_are_read(gateway, monkeypatch, path, body, param,
                                                                        message, reader):
    client, _, tokenizer, _ = gateway
    reads = []
    if reader is not None:
        module_name, name = reader.split(".")
        module = importlib.import_module(f"services.gateway.{module_name}")
        read = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *args, **kwargs: reads.append(args) or read(*args, **kwargs))
    response = await client.post(path, json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["message"].startswith(f"{param}: {message}"), error
    assert reads == [] and tokenizer.calls == 0


async def test_the_real_client_gets_the_refusal_by_name(gateway):
    client, _, _, _ = gateway
    async with openai.AsyncOpenAI(base_url=str(client.base_url).rstrip("/") + "/v1", api_key="unused",
                                  max_retries=0) as openai_client:
        with pytest.raises(openai.BadRequestError) as raised:
            await openai_client.chat.completions.create(model="tiny", messages=[EMPTY_TURN] * MAX_MODEL_LEN)
    assert raised.value.body["param"] == "messages"
    assert f"this model's context is {MAX_MODEL_LEN} tokens" in raised.value.body["message"]


async def test_with_truncation_token_ids_past_the_context_are_read_from_their_end(gateway):
    client, _, _, _ = gateway
    # the ids before the context's worth are dropped unread (a bad one among them is not
    # refused); the rest fit, and the request goes on to the workers, which never answer
    long_ids = {"prompt": [-1] + [5] * (2 * MAX_MODEL_LEN), "truncate_prompt_tokens": 8, "max_tokens": 1}
    response = await client.post(COMPLETIONS, json=long_ids)
    assert response.status_code == 503, response.text
    # turns are still counted: each renders to a token at least, so all but the last
    # context's worth would be cut whole
    turns = {"messages": [EMPTY_TURN] * MAX_MODEL_LEN, "truncate_prompt_tokens": 8, "max_tokens": 1}
    response = await client.post(CHAT, json=turns)
    assert response.status_code == 400 and response.json()["error"]["param"] == "messages"


# ---- malformed HTTP requests ----------------------------------------------------------------

SECRET = "sk-not-for-logs"


def _post(headers: str, body: bytes = b"{}") -> bytes:
    return f"POST /v1/completions HTTP/1.1\r\nHost: x\r\n{headers}\r\n".encode() + body


def _decodes(coding: str) -> bool:
    """Whether aiohttp here decodes the Content-Encoding (br and zstd need optional packages)."""
    from aiohttp import compression_utils

    return bool(getattr(compression_utils, {"br": "HAS_BROTLI", "zstd": "HAS_ZSTD"}[coding], False))


MALFORMED_REQUESTS = [
    ("request line", b"GARBAGE\r\n\r\n", 400),
    ("HTTPS on the HTTP port", b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + bytes(32) + b"\r\n\r\n", 400),
    ("HTTP version", b"GET /health HTTP/9.x\r\nHost: x\r\n\r\n", 400),
    ("request line too long", b"GET /" + b"a" * 10_000 + b" HTTP/1.1\r\nHost: x\r\n\r\n", 400),
    ("header name", _post("Bad Header: y\r\nContent-Length: 2\r\n"), 400),
    ("header value", _post(f"Authorization: Bearer {SECRET}\x01\r\nContent-Length: 2\r\n"), 400),
    ("two Content-Lengths", _post("Content-Length: 2\r\nContent-Length: 3\r\n"), 400),
    ("chunk size", _post("Transfer-Encoding: chunked\r\n", b"zz\r\n{}\r\n0\r\n\r\n"), 400),
    ("gzip that does not decode", _post("Content-Encoding: gzip\r\nContent-Length: 8\r\n", b"not json"), 400),
    ("br", _post("Content-Encoding: br\r\nContent-Length: 8\r\n", b"not json"), 400 if _decodes("br") else 415),
    ("zstd", _post("Content-Encoding: zstd\r\nContent-Length: 8\r\n", b"not json"), 400 if _decodes("zstd") else 415),
]


@pytest.mark.parametrize(("sent", "status"), [case[1:] for case in MALFORMED_REQUESTS],
                         ids=[case[0] for case in MALFORMED_REQUESTS])
async def test_malformed_http_requests_get_openai_errors_and_one_log_line(caplog, sent, status):
    """aiohttp answered these in plain text before any handler ran, and logged each at ERROR
    with a traceback of some fifteen lines (a body that did not decode: once the handler had
    answered, as aiohttp read the rest), so a client could flood the logs."""
    api = OpenAIApi(GatedBackend(), [ModelConfig(source="tiny")], str)
    runner = await start_http(api, "127.0.0.1:0")
    try:
        with structlog.testing.capture_logs() as logs, caplog.at_level(logging.DEBUG):
            answer = await _until_closed(bound_port(runner), sent)
    finally:
        await runner.cleanup()
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.split(b" ")[1] == str(status).encode(), answer
    assert b"Content-Type: application/json" in head, answer
    error = json.loads(body)["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    assert error["message"]
    if status == 415:
        assert error["param"] == "Content-Encoding" and b"Accept-Encoding: " in head
    assert not [record for record in caplog.records if record.levelno >= logging.INFO or record.exc_info], caplog.text
    (line,) = logs  # one line per request, without a traceback or the request's bytes
    assert line["log_level"] in ("debug", "info", "warning") and not {"exc_info", "exception"} & line.keys(), line
    assert SECRET not in str(line)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/v1/responses"])
@pytest.mark.parametrize(("coding", "status"), [("foo", 415), ("gzip, foo", 415), ("identity", 400)])
async def test_a_content_encoding_aiohttp_does_not_know_is_a_415(path, coding, status):
    # aiohttp passes such a body on undecoded: it was read as JSON, and answered "not valid JSON"
    api = OpenAIApi(GatedBackend(), [ModelConfig(source="tiny")], str)
    runner = await start_http(api, "127.0.0.1:0")
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{bound_port(runner)}", timeout=10) as client:
            response = await client.post(path, content=b"not json", headers={"Content-Type": "application/json",
                                                                            "Content-Encoding": coding})
    finally:
        await runner.cleanup()
    assert response.status_code == status, response.text
    error = response.json()["error"]
    if status == 415:
        assert error["param"] == "Content-Encoding" and error["type"] == "invalid_request_error"
        assert response.headers["Accept-Encoding"] == "gzip, deflate"
    else:  # no coding: the bytes as sent
        assert error["param"] == "body"


# ---- large bodies parse off the event loop ----------------------------------------------------

LARGE = INLINE_PARSE_MAX_BYTES + 1024


async def test_a_large_body_is_parsed_in_a_thread_while_the_loop_serves(monkeypatch):
    backend = GatedBackend()
    backend.go.set()
    api = OpenAIApi(backend, [ModelConfig(source="tiny")], str)
    runner = await start_http(api, "127.0.0.1:0")
    parsing, health_answered = threading.Event(), threading.Event()
    answered_while_parsing = []
    loads = json.loads

    def hold_until_health_answers(raw, *args, **kwargs):  # type: ignore[no-untyped-def]
        if len(raw) > INLINE_PARSE_MAX_BYTES:
            # on the event loop this would block the health check below: the wait times out
            parsing.set()
            answered_while_parsing.append(health_answered.wait(timeout=5))
        return loads(raw, *args, **kwargs)

    monkeypatch.setattr(json, "loads", hold_until_health_answers)
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{bound_port(runner)}", timeout=10) as client:
            body = json.dumps({"prompt": "x" * LARGE, "max_tokens": 2}).encode()
            request = asyncio.create_task(client.post("/v1/completions", content=body))
            assert await asyncio.to_thread(parsing.wait, 5)
            assert (await client.get("/health")).status_code == 200
            health_answered.set()
            response = await request
    finally:
        await runner.cleanup()
    assert answered_while_parsing == [True]
    assert response.status_code == 200 and response.json()["choices"][0]["text"] == "ab"


@pytest.mark.parametrize("body", [
    b'{"prompt": "' + b"a" * LARGE,  # unterminated string
    b'{"prompt": "' + b"a" * LARGE + b'\xff"}',  # not UTF-8
    b"[" * LARGE + b"]" * LARGE,  # deeper than the parser's recursion limit
    b'{"prompt": "' + b"a" * LARGE + b'"} trailing',
], ids=["unterminated", "not UTF-8", "too deep", "extra data"])
async def test_a_large_malformed_body_gets_the_same_400_as_a_small_one(body):
    try:
        json.loads(body)
    except RecursionError:
        expected = "body: is nested too deeply to parse"
    except ValueError as error:
        expected = f"body: is not valid JSON ({error})"
    api = OpenAIApi(GatedBackend(), [ModelConfig(source="tiny")], str)
    runner = await start_http(api, "127.0.0.1:0")
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{bound_port(runner)}", timeout=10) as client:
            response = await client.post("/v1/completions", content=body, headers={"Content-Type": "application/json"})
    finally:
        await runner.cleanup()
    assert response.status_code == 400
    assert response.json()["error"] == {"message": expected, "type": "invalid_request_error", "param": "body",
                                        "code": None}
