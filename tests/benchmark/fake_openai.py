"""A scripted OpenAI-compatible HTTP server for the benchmark's client tests.

It streams `tokens` chunks per request, cutting each SSE event across two writes so the
client's parser meets split chunks; `behaviour` picks a misbehaviour (see FakeOpenAI).
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web


@dataclass
class FakeOpenAI:
    """behaviour: "ok"; "no_usage" (ignores include_usage); "strict" (400 naming ignore_eos
    when sent); "needs_key" (401 without `Bearer secret`); "html" (200 text/html);
    "error_mid_stream" (an error event after the first token)."""

    behaviour: str = "ok"
    tokens_per_request: int | None = None  # None: the request's max_tokens
    step_s: float = 0.0
    bodies: list[dict[str, Any]] = field(default_factory=list)
    in_flight: int = 0
    max_in_flight: int = 0

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/v1/completions", self.complete)
        app.router.add_post("/v1/chat/completions", self.complete)
        return app

    async def models(self, request: web.Request) -> web.Response:
        if self.behaviour == "needs_key" and request.headers.get("Authorization") != "Bearer secret":
            return web.json_response({"error": {"message": "no API key"}}, status=401)
        return web.json_response({"object": "list", "data": [{"id": "fake-model", "object": "model"}]})

    async def complete(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        if self.behaviour == "needs_key" and request.headers.get("Authorization") != "Bearer secret":
            sent = "a wrong API key" if "Authorization" in request.headers else "no API key"
            return web.json_response({"error": {"message": f"{sent} was sent"}}, status=401)
        if self.behaviour == "strict" and "ignore_eos" in body:
            return web.json_response({"error": {"message": "unknown parameter: ignore_eos"}}, status=400)
        if self.behaviour == "html":
            return web.Response(text="<html>welcome</html>", content_type="text/html")
        chat = request.path.endswith("chat/completions")
        count = self.tokens_per_request or body.get("max_tokens") or body.get("max_completion_tokens")
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await response.prepare(request)
            for index in range(count):
                await asyncio.sleep(self.step_s)
                finish = "length" if index == count - 1 else None
                if chat:
                    delta = {"role": "assistant", "content": ""} if index == 0 else {}
                    delta["reasoning_content" if index % 2 else "content"] = f"t{index} é"
                    choice = {"index": 0, "delta": delta, "finish_reason": finish}
                else:
                    choice = {"index": 0, "text": f"t{index} é", "finish_reason": finish}
                await _write_split(response, {"id": "x", "choices": [choice]})
                if self.behaviour == "error_mid_stream":
                    await _write_split(response, {"error": {"message": "the worker went away", "code": 503}})
                    break
            if body.get("stream_options", {}).get("include_usage") and self.behaviour != "no_usage":
                await _write_split(response, {"id": "x", "choices": [],
                                              "usage": {"prompt_tokens": 7, "completion_tokens": count}})
            await response.write(b"data: [DONE]\n\n")
            await response.write_eof()
            return response
        finally:
            self.in_flight -= 1


async def _write_split(response: web.StreamResponse, payload: dict[str, Any]) -> None:
    data = f"data: {json.dumps(payload, ensure_ascii=False)}\n\n".encode()
    cut = len(data) - 3  # inside the JSON's tail: "é" and "}" arrive in the next write
    await response.write(data[:cut])  # two writes: the halves can reach the client apart
    await response.write(data[cut:])
