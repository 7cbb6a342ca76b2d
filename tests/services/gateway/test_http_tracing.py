"""The OpenAI HTTP API under tracing: a server span per request under its traceparent
header, gateway.first_byte in the stream, and a 400 naming a malformed traceparent."""

from __future__ import annotations

import json

import httpx
import pytest
from opentelemetry.trace import SpanKind

from cleave.config import ModelConfig
from cleave.generation.outputs import FinishReason
from cleave.rpc.types import Usage
from services.gateway.backend import GenerateChunk, SampleOutput
from services.gateway.http_api import OpenAIApi, bound_port, start_http
from tests.tracing.helpers import by_name, memory_tracing

VALID = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
BODY = {"model": "tiny", "prompt": "hi", "max_tokens": 2}


class OneChunkBackend:
    """Answers every request with one chunk of text, then usage."""

    def __init__(self) -> None:
        self.num_requests = 0

    async def generate(self, spec):  # type: ignore[no-untyped-def]
        self.num_requests += 1
        yield GenerateChunk(samples=(SampleOutput(index=0, text="ok", token_ids=(5, 6),
                                                  finish_reason=FinishReason.LENGTH),))
        yield GenerateChunk(usage=Usage(prompt_tokens=1, completion_tokens=2))


@pytest.fixture
async def served():
    tracing, spans = memory_tracing("cleave-gateway")
    backend = OneChunkBackend()
    api = OpenAIApi(backend, [ModelConfig(source="tiny")], str, tracing=tracing)
    runner = await start_http(api, "127.0.0.1:0")
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{bound_port(runner)}") as client:
        yield client, backend, spans
    await runner.cleanup()


async def test_malformed_traceparent_is_a_400_naming_it(served):
    client, backend, spans = served
    response = await client.post("/v1/completions", json=BODY, headers={"traceparent": "00-xyz-01"})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "traceparent" and error["type"] == "invalid_request_error"
    assert error["message"].startswith("traceparent: the value '00-xyz-01' does not parse as W3C trace context")
    assert backend.num_requests == 0 and spans.get_finished_spans() == ()


async def test_a_streamed_completion_is_a_server_span_with_its_first_byte(served):
    client, _, spans = served
    response = await client.post("/v1/completions", json={**BODY, "stream": True}, headers={"traceparent": VALID})
    assert response.status_code == 200
    events = [line.removeprefix("data: ") for line in response.text.splitlines() if line]
    assert json.loads(events[0])["choices"][0]["text"] == "ok" and events[-1] == "[DONE]"
    finished = spans.get_finished_spans()
    server = by_name(finished, "POST /v1/completions")
    first_byte = by_name(finished, "gateway.first_byte")
    assert server.kind is SpanKind.SERVER
    assert format(server.context.trace_id, "032x") == VALID.split("-")[1]
    assert format(server.parent.span_id, "016x") == VALID.split("-")[2]
    assert server.attributes["http.status_code"] == 200
    assert server.attributes["request_id"].startswith("cmpl-")
    assert first_byte.parent.span_id == server.context.span_id
    assert first_byte.attributes["request_id"] == server.attributes["request_id"]
    assert server.start_time <= first_byte.start_time <= first_byte.end_time <= server.end_time


async def test_untraced_requests_are_root_spans(served):
    client, _, spans = served
    response = await client.post("/v1/completions", json=BODY)
    assert response.status_code == 200 and response.json()["choices"][0]["text"] == "ok"
    (server,) = spans.get_finished_spans()  # no stream, no first_byte
    assert server.parent is None and server.name == "POST /v1/completions"
