"""A client that leaves in the middle of a streamed HTTP answer: the request is aborted (its
stream closed, which frees its KV on the worker), the gateway logs one line below WARNING
without a traceback, and no error answer is attempted on the closed connection."""

from __future__ import annotations

import asyncio
import json
import logging

import pytest
import structlog

from cleave.config import ModelConfig
from cleave.generation.outputs import FinishReason
from cleave.rpc.types import Usage
from services.gateway.backend import GenerateChunk, SampleOutput
from services.gateway.http_api import OpenAIApi, bound_port, start_http
from tests.tracing.helpers import by_name, memory_tracing


class ChunkInHandBackend:
    """Streams one chunk, then holds the next until the client's leaving cancels the handler,
    and hands it over anyway: a handler that resumes with a chunk after aiohttp saw the
    connection close (the chunk's wake-up was queued first) writes to a closed transport.

    `closed` is set once the stream is closed; `completed` says whether it ran to its end."""

    def __init__(self) -> None:
        self.closed = asyncio.Event()
        self.completed = False

    async def generate(self, spec):  # type: ignore[no-untyped-def]
        try:
            yield GenerateChunk(samples=(SampleOutput(index=0, text="a", token_ids=(1,)),))
            try:
                await asyncio.Event().wait()  # never set: the handler's cancellation ends the wait
            except asyncio.CancelledError:
                pass  # the next chunk was already on its way
            yield GenerateChunk(samples=(SampleOutput(index=0, text="b", token_ids=(2,)),))
            yield GenerateChunk(
                samples=(SampleOutput(index=0, text="c", token_ids=(3,), finish_reason=FinishReason.STOP),),
                usage=Usage(prompt_tokens=1, completion_tokens=3))
            self.completed = True
        finally:
            self.closed.set()


async def _stream_then_leave(port: int, path: str, body: dict) -> bytes:  # type: ignore[type-arg]
    """Send a streamed request, read up to its first event and close the socket; returns
    what was read."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        payload = json.dumps(body).encode()
        writer.write(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {len(payload)}\r\n\r\n".encode() + payload)
        await writer.drain()
        return await asyncio.wait_for(reader.readuntil(b"\n\n"), timeout=10)
    finally:
        writer.close()
        await writer.wait_closed()


STREAMED = [
    ("/v1/completions", {"prompt": "hi", "max_tokens": 3, "stream": True}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "stream": True}),
    ("/v1/responses", {"input": "hi", "stream": True}),
]


@pytest.mark.parametrize(("path", "body"), STREAMED, ids=[path for path, _ in STREAMED])
async def test_a_client_leaving_mid_stream_aborts_the_request_quietly(caplog, path, body):
    backend = ChunkInHandBackend()
    tracing, spans = memory_tracing("cleave-gateway")
    api = OpenAIApi(backend, [ModelConfig(source="tiny")], str, tracing=tracing)
    runner = await start_http(api, "127.0.0.1:0")
    try:
        with structlog.testing.capture_logs() as logs, caplog.at_level(logging.DEBUG):
            head = await _stream_then_leave(bound_port(runner), path, body)
            await asyncio.wait_for(backend.closed.wait(), timeout=10)
        assert head.startswith(b"HTTP/1.1 200 ") and b"data: " in head, head
        assert not backend.completed  # aborted: the stream was closed before its end
        assert not [entry for entry in logs if entry["log_level"] in ("warning", "error", "critical")], logs
        assert not [record for record in caplog.records if record.levelno >= logging.WARNING], caplog.text
        (left,) = logs
        assert left["log_level"] in ("info", "debug") and "exc_info" not in left and "exception" not in left
        assert left["request_id"] and "client" in left["event"]
        server = by_name(spans.get_finished_spans(), f"POST {path}")
        assert server.attributes["http.status_code"] == 200 and server.status.is_ok  # no error answer was made
    finally:
        await runner.cleanup()
