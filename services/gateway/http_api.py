"""OpenAI-compatible HTTP API (aiohttp) over the same `GatewayBackend` as the gRPC API.

    GET  /v1/models
    GET  /v1/models/{id}
    POST /v1/completions         prompt: text (no chat template) or token ids, or a list of
                                 them; `echo` (`completions_batch`)
    POST /v1/chat/completions    messages through the chat template
    POST /v1/responses           OpenAI's Responses API on the chat path (`responses_api`)
    POST /tokenize, /detokenize  vLLM's extension routes (`tokenize_api`)
    GET  /health                 liveness: 200 while the process serves HTTP
    GET  /ready                  readiness: 200 while a request can be routed to a worker,
                                 else 503 with the reason and `Retry-After`

Streaming answers are server-sent events (`data: {...}\\n\\n`, then `data: [DONE]\\n\\n`).
Reasoning models put their thinking in `reasoning_content` of the chat message (or delta),
as vLLM and DeepSeek do, and count it in `usage.completion_tokens_details.reasoning_tokens`.
vLLM's `prompt_logprobs`, `return_token_ids` and `include_stop_str_in_output` are answered
in vLLM's shapes (`_Shaper`, `prompt_scores`).
A client that disconnects cancels its handler (or fails its next write), which aborts the
request on the worker and is logged once at INFO, without an error answer.
Every request runs in a server span under its `traceparent` header (`cleave.tracing`; a
malformed one is a 400 naming it); a stream's first chunk with tokens is `gateway.first_byte`.
With an API key, every /v1 route asks for `Authorization: Bearer <key>` (401 otherwise).
A body over `max_request_bytes` is a 413, one that is not JSON a 400, one in a
Content-Encoding no decoder knows a 415, one that stops arriving a 408 (`http_body`); a
connection that sends no whole request head within the idle timeout is closed, as is one
idle that long between requests, and one past the connection cap is answered 503
(`http_errors`). Every other malformed field
is a 400 naming it (`openai_request`), and so is a field the gateway cannot honour
(`openai_fields`); unknown paths are OpenAI-shaped 404s, and requests aiohttp cannot parse
OpenAI-shaped 400s (415 for a Content-Encoding it cannot decode), each logged in one WARNING
line (`http_errors`). A request refused because no worker can take it is a 503 with
`Retry-After`.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from typing import Any

import structlog
from aiohttp import web
from prometheus_client import CollectorRegistry

from cleave.api_keys import ApiKeys
from cleave.config import DEFAULT_MAX_REQUEST_BYTES, ModelConfig
from cleave.errors import InvalidArgument, NotFound, Unauthenticated, Unavailable
from cleave.metrics.exposition import metrics_handler
from cleave.rpc.connection_limits import connection_cap
from cleave.rpc.types import TopLogprobs, Usage
from cleave.tls import TlsConfig
from cleave.tracing import NOOP_SPAN, TRACEPARENT, TRACESTATE, TRACING_OFF, Tracing, annotate, span
from services.gateway.backend import GatewayBackend, GenerateChunk, GenerateSpec, Prompt, SampleOutput
from services.gateway.completions_batch import complete_batch
from services.gateway.http_body import DEFAULT_BODY_TIMEOUT_S, expect_handler, read_json
from services.gateway.http_errors import AppRunner, json_routing_errors
from services.gateway.model import ServedModel
from services.gateway.openai_request import (
    HttpError,
    completion_prompts,
    generate_spec,
    http_error,
    include_usage,
    param_names,
    retry_after_headers,
)
from services.gateway.openai_tools import call_json
from services.gateway.prompt_scores import vllm_prompt_logprobs
from services.gateway.readiness import Routability
from services.gateway.request_names import context_length, resolve_model
from services.gateway.responses_api import ResponseShaper, responses_body
from services.gateway.responses_api import param_names as responses_param_names
from services.gateway.tenants import TenantBackend
from services.gateway.tokenize_api import PARAM_NAMES as TOKENIZE_PARAMS
from services.gateway.tokenize_api import detokenize, tokenize

log = structlog.get_logger("cleave.gateway.http")
OPEN_PATHS = frozenset({"/health", "/ready", "/metrics"})  # served without the API key (probes, Prometheus)
# a request's tenant, with several API keys (`_authorized`); older aiohttp keys requests by str
TENANT_KEY = web.RequestKey("cleave.tenant", str) if hasattr(web, "RequestKey") else "cleave.tenant"
DEFAULT_IDLE_TIMEOUT_S = 75.0  # aiohttp's run_app default; a bare AppRunner waits an hour
_REQUEST_TIMEOUT = 408


def usage_json(usage: Usage) -> dict[str, Any]:
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        "completion_tokens_details": {"reasoning_tokens": usage.reasoning_tokens},
        "prompt_tokens_details": {"cached_tokens": usage.cached_prompt_tokens},
    }


class OpenAIApi:
    """The HTTP handlers.

    Args:
        backend: the gateway's serving logic.
        models: served models, the first is the default.
        token_text: token id -> its text (for logprobs).
        tracing: where each request's server span goes (off by default).
        max_request_bytes: larger request bodies are refused with 413 (`http_body`).
        api_keys: every route but the probes and the metrics asks for `Authorization:
            Bearer <key>` of one of them (401 otherwise); with several, each key's requests
            run as its tenant (`services.gateway.tenants`); a string: that one key; None:
            no key asked.
        routability: what `/ready` reports (`RoutingBackend.routability`); None: ready
            whenever the process serves.
        metrics_registry: served at `/metrics` (Prometheus text, no API key); None: no route.
        served_model: the tokenizer behind `/tokenize`, `/detokenize` and completions' `echo` of
            token-id prompts; None: no tokenize routes.
        idle_timeout_s: a connection that sends no whole request head within this, or idles
            this long between requests, is closed (`start_http`).
        body_timeout_s: a request body must arrive whole within this (408 otherwise).
    """

    def __init__(self, backend: GatewayBackend, models: Sequence[ModelConfig], token_text,  # type: ignore[no-untyped-def]
                 tracing: Tracing = TRACING_OFF, api_keys: ApiKeys | str | None = None,
                 max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
                 routability: Routability | None = None, metrics_registry: CollectorRegistry | None = None,
                 served_model: ServedModel | None = None, idle_timeout_s: float = DEFAULT_IDLE_TIMEOUT_S,
                 body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S) -> None:
        self.backend = backend
        self.idle_timeout_s = idle_timeout_s
        self.body_timeout_s = body_timeout_s
        self.metrics_registry = metrics_registry
        self.routability = routability
        self.max_request_bytes = max_request_bytes
        self.api_keys = ApiKeys((api_keys,)) if isinstance(api_keys, str) else api_keys
        self.models = tuple(models)
        self.token_text = token_text
        self.served_model = served_model
        self.tracing = tracing

    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.max_request_bytes,
                              middlewares=[self._traced, self._authorized, json_routing_errors])
        within_limit = expect_handler(self.max_request_bytes)
        app.router.add_get("/v1/models", self.list_models, expect_handler=within_limit)
        app.router.add_get("/v1/models/{model_id:.+}", self.get_model, expect_handler=within_limit)
        app.router.add_post("/v1/completions", self.completions, expect_handler=within_limit)
        app.router.add_post("/v1/chat/completions", self.chat_completions, expect_handler=within_limit)
        app.router.add_post("/v1/responses", self.responses, expect_handler=within_limit)
        app.router.add_get("/health", self.health, expect_handler=within_limit)
        app.router.add_get("/ready", self.ready, expect_handler=within_limit)
        if self.served_model is not None:  # vLLM's extension routes (lm-eval's harness uses them)
            app.router.add_post("/tokenize", self._tokenizer_route(tokenize), expect_handler=within_limit)
            app.router.add_post("/detokenize", self._tokenizer_route(detokenize), expect_handler=within_limit)
        if self.metrics_registry is not None:
            app.router.add_get("/metrics", metrics_handler(self.metrics_registry), expect_handler=within_limit)
        return app

    @web.middleware
    async def _traced(self, request: web.Request, handler) -> web.StreamResponse:  # type: ignore[no-untyped-def]
        """Run the handler in the request's server span (ended once the response, streamed
        or not, is complete)."""
        try:
            server_span = self.tracing.start_server_span(
                f"{request.method} {request.path}", request.headers.get(TRACEPARENT), request.headers.get(TRACESTATE),
                **{"http.method": request.method, "http.route": request.path},
            )
        except InvalidArgument as error:
            mapped = http_error(error, {})
            return web.json_response(mapped.body, status=mapped.status)
        try:
            response = await handler(request)
        except asyncio.CancelledError:  # the client went away: not the server's fault
            server_span.end(cancelled=True)
            raise
        except BaseException as error:
            server_span.end(error=type(error).__name__)
            raise
        server_span.end(error=f"HTTP {response.status}" if response.status >= 500 else None,
                        **{"http.status_code": response.status})
        return response

    @web.middleware
    async def _authorized(self, request: web.Request, handler) -> web.StreamResponse:  # type: ignore[no-untyped-def]
        """Refuse a request without an API key (401, OpenAI's error shape), except the
        probes and the metrics (`OPEN_PATHS`): the tokenizer routes do work for a caller too.
        With several keys, the request runs as the tenant of the key it sent (`_backend`)."""
        keys = self.api_keys
        if keys is None or request.path in OPEN_PATHS:
            return await handler(request)
        tenant = keys.tenant(request.headers.get("Authorization"))
        if tenant is not None:
            if not keys.isolates:
                return await handler(request)
            request[TENANT_KEY] = tenant
            # the request's log lines name its tenant (the key's tag); reset after it, since one
            # keep-alive connection's requests share a task
            with structlog.contextvars.bound_contextvars(tenant=tenant):
                return await handler(request)
        sent = "a wrong API key" if "Authorization" in request.headers else "no API key"
        mapped = http_error(Unauthenticated(
            f"{sent} was sent; send 'Authorization: Bearer <key>' with the gateway's --api-key"), {})
        return web.json_response(mapped.body, status=mapped.status, headers={"WWW-Authenticate": "Bearer"})

    async def health(self, request: web.Request) -> web.Response:
        """Liveness: the process answers (Kubernetes livenessProbe; restarting the gateway
        would not bring workers back)."""
        return web.json_response({"status": "ok"})

    async def ready(self, request: web.Request) -> web.Response:
        """Readiness: 200 while a request can be routed, else 503 with why (Kubernetes
        readinessProbe, load balancers)."""
        reason = self.routability.reason if self.routability is not None else None
        if reason is None:
            return web.json_response({"status": "ok"})
        return web.json_response({"status": "unavailable", "reason": reason}, status=503,
                                 headers=retry_after_headers(Unavailable.retry_after_s))

    async def list_models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [_model_card(m) for m in self.models]})

    async def get_model(self, request: web.Request) -> web.Response:
        """`GET /v1/models/{id}` (ids may hold slashes: `ORG/NAME`)."""
        model_id = request.match_info["model_id"]
        try:
            resolve_model(self.models, model_id)
        except NotFound as error:
            mapped = http_error(error, {})
            return web.json_response(mapped.body, status=mapped.status)
        return web.json_response(_model_card(next(m for m in self.models if m.id == model_id)))

    def _tokenizer_route(self, answer):  # type: ignore[no-untyped-def]
        async def handle(request: web.Request) -> web.Response:
            try:
                body = await read_json(request, self.max_request_bytes, self.body_timeout_s)
                self._model(body)
                return web.json_response(await answer(self.served_model, body))
            except Exception as error:
                return _error_response(http_error(error, TOKENIZE_PARAMS))
        return handle

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, chat=False)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, chat=True)

    async def responses(self, request: web.Request) -> web.StreamResponse:
        """OpenAI's Responses API on the chat path (`responses_api`)."""
        async def respond(body: Any, request_id: str) -> web.StreamResponse:
            model = self._model(body)
            context = context_length(self.models, model)
            spec, stream = generate_spec(responses_body(body, context), request_id, model, chat=True,
                                         max_context_length=context)
            shaper = ResponseShaper(spec, body)
            return await self._generated(request, spec, stream, shaper, shaper.response, self._stream_response)

        return await self._handle(request, f"resp-{uuid.uuid4().hex}", responses_param_names, respond)

    async def _handle(self, request: web.Request, request_id: str, params: Callable[[Any], dict[str, str]],
                      respond: Callable[[Any, str], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
        """Read the body and answer it with `respond(body, request_id)`; every failure becomes an
        OpenAI error body (its field named as `params(body)` maps it; None: no body read)."""
        annotate(request_id=request_id)
        body = None
        try:
            body = await read_json(request, self.max_request_bytes, self.body_timeout_s)
            return await respond(body, request_id)
        except Exception as error:
            mapped = http_error(error, params(body))
            if mapped.status == 500:
                log.exception("request failed", request_id=request_id)
            return _error_response(mapped)

    async def _generated(self, request: web.Request, spec: GenerateSpec, stream: bool, shaper: Any,
                         whole: Callable[[], dict[str, Any]], streamer: Any) -> web.StreamResponse:
        """Run the request: streamed by `streamer(request, chunks, shaper)`, or every chunk into
        `shaper.add` and the `whole()` answer."""
        chunks = self._backend(request).generate(spec)
        async with contextlib.aclosing(chunks):
            if stream:
                return await streamer(request, chunks, shaper)
            async for chunk in chunks:
                shaper.add(chunk)
            return web.json_response(whole())

    async def _stream_response(self, request: web.Request, chunks: AsyncIterator[GenerateChunk],
                               shaper: ResponseShaper) -> web.StreamResponse:
        first = await anext(chunks, None)  # errors before the first token still get a status
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        with _unless_client_left(request, shaper.spec.request_id):
            await response.prepare(request)
            try:
                await response.write(shaper.start_events())
                if first is not None:
                    await response.write(shaper.events(first))
                    async for chunk in chunks:
                        if data := shaper.events(chunk):
                            await response.write(data)
                await response.write(shaper.end_events())
            except Exception as error:  # after the headers went out, an error travels as an event
                if isinstance(error, ConnectionResetError):
                    raise
                await response.write(shaper.error_event(http_error(error, responses_param_names(shaper.request)).body))
            await response.write_eof()
        return response

    def _model(self, body: Any) -> str:
        return resolve_model(self.models, body.get("model") if isinstance(body, dict) else None)

    async def _serve(self, request: web.Request, chat: bool) -> web.StreamResponse:
        async def respond(body: Any, request_id: str) -> web.StreamResponse:
            model = self._model(body)
            context = context_length(self.models, model)
            prompt = None
            if not chat and isinstance(body, dict):
                prompts = completion_prompts(body, context)
                if len(prompts) > 1 or body.get("echo"):
                    return web.json_response(await self._complete_batch(request, body, request_id, model, prompts))
                prompt = prompts[0]
            spec, stream = generate_spec(body, request_id, model, chat, prompt, max_context_length=context)
            shaper = _Shaper(spec, chat, self.token_text, include_usage=include_usage(body, stream))
            return await self._generated(request, spec, stream, shaper, shaper.complete, self._stream)

        request_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        return await self._handle(request, request_id, lambda body: param_names(body, chat), respond)

    def _backend(self, request: web.Request) -> GatewayBackend:
        """The backend as the request's tenant reaches it (the backend itself with one key)."""
        tenant = request.get(TENANT_KEY)
        if tenant is None or self.api_keys is None:
            return self.backend
        return TenantBackend(self.backend, tenant, self.api_keys.priority_floor(tenant))

    async def _complete_batch(self, request: web.Request, body: dict[str, Any], request_id: str, model: str,
                              prompts: list[Prompt]) -> dict[str, Any]:
        answer, usage = await complete_batch(self._backend(request), body, request_id, model, prompts,
                                             lambda spec: _Shaper(spec, False, self.token_text, include_usage=False),
                                             self._prompt_text, self.token_text)
        return {**answer, "usage": usage_json(usage)}

    def _prompt_text(self, prompt: Prompt) -> str:
        if prompt.text is not None:
            return prompt.text
        ids = list(prompt.token_ids or ())
        if self.served_model is not None:
            return self.served_model.tokenizer.decode(ids)
        return "".join(self.token_text(token_id) for token_id in ids)

    async def _stream(
        self, request: web.Request, chunks: AsyncIterator[GenerateChunk], shaper: "_Shaper"
    ) -> web.StreamResponse:
        first = await anext(chunks, None)  # errors before the first token still get a status
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        with _unless_client_left(request, shaper.spec.request_id):
            await response.prepare(request)
            try:
                if first is not None:
                    # a chunk with samples carries tokens; one without ends a request that made none
                    with span("gateway.first_byte", request_id=shaper.spec.request_id) if first.samples else NOOP_SPAN:
                        await response.write(shaper.sse(first))
                    async for chunk in chunks:  # one write per chunk, whatever its samples
                        if data := shaper.sse(chunk):
                            await response.write(data)
                if shaper.include_usage:
                    await response.write(_sse(shaper.usage_event()))
            except Exception as error:  # after the headers went out, an error travels as an event
                if isinstance(error, ConnectionResetError):
                    raise
                await response.write(_sse(http_error(error, {}).body))
            await response.write(b"data: [DONE]\n\n")
            await response.write_eof()
        return response


@contextlib.contextmanager
def _unless_client_left(request: web.Request, request_id: str) -> Iterator[None]:
    """Around a stream's writes: a client that went away ends them, logged once at INFO.

    aiohttp cancels the handler when it sees the connection close, but a handler that resumes
    first (a chunk's wake-up was already queued) meets the close as a ConnectionResetError
    from its next write. Either way the stream's chunks are closed, which aborts the request
    on its worker; a client going away is not a failure, and no answer can reach it, so the
    stream's response is returned as it is (aiohttp finishes it quietly)."""
    try:
        yield
    except ConnectionResetError:
        if request.transport is not None and not request.transport.is_closing():
            raise  # the connection is still up: not the client leaving
        log.info("client went away mid-stream", request_id=request_id)
        annotate(cancelled=True)


def _error_response(mapped: HttpError) -> web.Response:
    response = web.json_response(mapped.body, status=mapped.status, headers=mapped.headers)
    if mapped.status == _REQUEST_TIMEOUT:
        response.force_close()  # the rest of the body is still on its way: no next request can follow it
    return response


def _model_card(model: ModelConfig) -> dict[str, Any]:
    return {"id": model.id, "object": "model", "created": 0, "owned_by": "cleave", "root": model.source,
            "max_model_len": model.max_context_length}


def _sample_state() -> dict[str, Any]:
    """What `_Shaper` gathers of one sample for a whole response."""
    return {"text": [], "reasoning": [], "finish_reason": None, "logprobs": [], "tool_calls": [], "token_ids": []}


def _finish_reason(reason: str | None, num_tool_calls: int) -> str | None:
    """OpenAI's finish reason: an answer that called tools and then stopped finished with "tool_calls"."""
    return "tool_calls" if reason == "stop" and num_tool_calls else reason


def _sse(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload, ensure_ascii=False).encode() + b"\n\n"


class _Shaper:
    """Builds OpenAI response objects from GenerateChunks (whole or streamed).

    vLLM's extra fields, where the request asked for them: `prompt_logprobs` (`prompt_scores`;
    chat: at the top level, completions: on each choice; never streamed) and, with
    `return_token_ids`, `prompt_token_ids` (chat: at the top level, completions: on each
    choice; streamed: on each choice's first event) and each choice's `token_ids` (streamed:
    the event's new ones)."""

    def __init__(self, spec: GenerateSpec, chat: bool, token_text, include_usage: bool) -> None:  # type: ignore[no-untyped-def]
        self.spec = spec
        self.chat = chat
        self.token_text = token_text
        self.include_usage = include_usage
        self.created = int(time.time())
        self.usage = Usage()
        self.samples: dict[int, dict[str, Any]] = {i: _sample_state() for i in range(spec.sampling.n)}
        self._started: set[int] = set()  # samples whose first event went out (streamed)
        self._sse_prefix: bytes | None = None  # b'data: {"id": ..., "choices": ' of every streamed event
        self._streamed_chars: dict[int, int] = {}  # completions: characters of text streamed per sample
        self._streamed_calls: dict[int, int] = {}  # chat: tool calls streamed per sample
        self.prompt_logprobs: tuple[TopLogprobs, ...] = ()  # with prompt logprobs asked (echo)
        self.prompt_token_ids: tuple[int, ...] = ()

    def add(self, chunk: GenerateChunk) -> None:
        if chunk.usage is not None:
            self.usage = chunk.usage
        self._take_prompt(chunk)
        for sample in chunk.samples:
            state = self.samples.setdefault(sample.index, _sample_state())
            state["token_ids"].extend(sample.token_ids)
            state["text"].append(sample.text)
            state["reasoning"].append(sample.reasoning_text)
            state["logprobs"].extend(sample.logprobs)
            state["tool_calls"].extend(sample.tool_calls)
            if sample.finish_reason is not None:
                state["finish_reason"] = sample.finish_reason.value

    def _take_prompt(self, chunk: GenerateChunk) -> None:
        """The prompt's ids and scores, from the chunk that carries them (the ids may come
        first alone, with `return_token_ids`)."""
        if chunk.prompt_token_ids:
            self.prompt_token_ids = chunk.prompt_token_ids
        if chunk.prompt_logprobs:
            self.prompt_logprobs = chunk.prompt_logprobs

    def _prompt_fields(self) -> dict[str, Any]:
        """vLLM's `prompt_logprobs` and `prompt_token_ids`, those the request asked for."""
        fields: dict[str, Any] = {}
        num_top = self.spec.sampling.prompt_logprobs
        if num_top is not None:
            fields["prompt_logprobs"] = vllm_prompt_logprobs(self.prompt_token_ids, self.prompt_logprobs, num_top,
                                                             self.token_text)
        if self.spec.stream.include_prompt_token_ids:
            fields["prompt_token_ids"] = list(self.prompt_token_ids)
        return fields

    def _logprobs(self, entries: Sequence[TopLogprobs], text_start: int = 0) -> dict[str, Any] | None:
        """OpenAI logprobs of `entries`; completions' `text_offset` counts from `text_start`
        (the characters of the choice's text before the first entry)."""
        if self.spec.sampling.logprobs is None:
            return None
        if self.chat:
            return {"content": [
                {"token": self.token_text(e.sampled.token_id), "logprob": e.sampled.logprob, "bytes": None,
                 "top_logprobs": [{"token": self.token_text(t.token_id), "logprob": t.logprob, "bytes": None}
                                  for t in e.top]}
                for e in entries
            ]}
        tokens = [self.token_text(e.sampled.token_id) for e in entries]
        return {
            "tokens": tokens,
            "token_logprobs": [e.sampled.logprob for e in entries],
            "top_logprobs": [{self.token_text(t.token_id): t.logprob for t in e.top} for e in entries],
            "text_offset": list(itertools.accumulate((len(token) for token in tokens[:-1]), initial=text_start))
            if tokens else [],
        }

    def complete(self) -> dict[str, Any]:
        choices = []
        prompt_fields = self._prompt_fields()
        return_token_ids = self.spec.stream.include_prompt_token_ids
        for index in sorted(self.samples):
            state = self.samples[index]
            text = "".join(state["text"])
            calls = state["tool_calls"]
            choice: dict[str, Any] = {"index": index, "finish_reason": _finish_reason(state["finish_reason"], len(calls)),
                                      "logprobs": self._logprobs(state["logprobs"])}
            if self.chat:
                reasoning = "".join(state["reasoning"])
                choice["message"] = {"role": "assistant", "content": None if calls and not text.strip() else text,
                                     "reasoning_content": reasoning or None}
                if calls:
                    choice["message"]["tool_calls"] = [call_json(call) for call in calls]
            else:
                choice["text"] = text
                choice.update(prompt_fields)
            if return_token_ids:
                choice["token_ids"] = list(state["token_ids"])
            choices.append(choice)
        response = {
            "id": self.spec.request_id,
            "object": "chat.completion" if self.chat else "text_completion",
            "created": self.created,
            "model": self.spec.model,
            "choices": choices,
            "usage": usage_json(self.usage),
        }
        return {**response, **prompt_fields} if self.chat else response

    def _event(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": self.spec.request_id,
            "object": "chat.completion.chunk" if self.chat else "text_completion",
            "created": self.created,
            "model": self.spec.model,
            "choices": choices,
        }

    def sse(self, chunk: GenerateChunk) -> bytes:
        """The chunk's server-sent events, one per sample (b"" for none): byte for byte
        `_sse(self._event([delta]))`, with the event's fixed fields encoded once per request."""
        if chunk.usage is not None:
            self.usage = chunk.usage
        self._take_prompt(chunk)
        if self._sse_prefix is None:
            head = json.dumps(self._event([]), ensure_ascii=False).encode()
            assert head.endswith(b', "choices": []}')  # "choices" is the event's last key
            self._sse_prefix = b"data: " + head[:-len(b"[]}")]
        prefix = self._sse_prefix
        return b"".join(self._sample_event(prefix, sample) for sample in chunk.samples)

    def _sample_event(self, prefix: bytes, sample: SampleOutput) -> bytes:
        """One sample's event: `prefix`, its choice, then the fields after the choices."""
        choice, after = self._streamed(sample)
        tail = b"}\n\n" if not after else b", " + json.dumps(after, ensure_ascii=False).encode()[1:] + b"\n\n"
        return prefix + json.dumps([choice], ensure_ascii=False).encode() + tail

    def _streamed(self, sample: SampleOutput) -> tuple[dict[str, Any], dict[str, Any]]:
        """A sample's streamed choice, and the event's fields after `choices`: with
        `return_token_ids`, a chat sample's first event carries the prompt's ids, as vLLM's
        first chunk of each choice does."""
        first = sample.index not in self._started
        self._started.add(sample.index)
        choice = self._choice_delta(sample, first)
        if self.chat and first and self.spec.stream.include_prompt_token_ids:
            return choice, {"prompt_token_ids": list(self.prompt_token_ids)}
        return choice, {}

    def _choice_delta(self, sample: SampleOutput, first: bool) -> dict[str, Any]:
        finish = sample.finish_reason.value if sample.finish_reason is not None else None
        text_start = self._streamed_chars.get(sample.index, 0)
        self._streamed_chars[sample.index] = text_start + len(sample.text)
        logprobs = self._logprobs(sample.logprobs, text_start) if sample.logprobs else None
        return_token_ids = self.spec.stream.include_prompt_token_ids
        if not self.chat:
            choice = {"index": sample.index, "text": sample.text, "logprobs": logprobs, "finish_reason": finish}
            if return_token_ids:  # vLLM's stream: the prompt's ids on a choice's first chunk, null after
                choice["prompt_token_ids"] = list(self.prompt_token_ids) if first else None
                choice["token_ids"] = list(sample.token_ids)
            return choice
        delta: dict[str, Any] = {}
        if first:
            delta["role"] = "assistant"
        if sample.text:
            delta["content"] = sample.text
        if sample.reasoning_text:
            delta["reasoning_content"] = sample.reasoning_text
        num_calls = self._streamed_calls.get(sample.index, 0)
        if sample.tool_calls:
            delta["tool_calls"] = [{"index": num_calls + k, **call_json(call)} for k, call in enumerate(sample.tool_calls)]
            num_calls = self._streamed_calls[sample.index] = num_calls + len(sample.tool_calls)
        choice = {"index": sample.index, "delta": delta, "logprobs": logprobs,
                  "finish_reason": _finish_reason(finish, num_calls)}
        if return_token_ids:
            choice["token_ids"] = list(sample.token_ids)
        return choice

    def usage_event(self) -> dict[str, Any]:
        event = self._event([])
        event["usage"] = usage_json(self.usage)
        return event


async def start_http(api: OpenAIApi, address: str, share_port: bool = False,
                     max_connections: int | None = None, *, tls: TlsConfig | None = None) -> web.AppRunner:
    """Serve the API on host:port in the running event loop (port 0: any free port;
    `share_port`: SO_REUSEPORT, for gateway replicas on one port; `max_connections`: open
    connections past which a new one is answered 503, None: from the open-file limit; `tls`:
    HTTPS with its certificate, no client certificate asked)."""
    host, _, port = address.rpartition(":")
    runner = AppRunner(api.app(), handler_cancellation=True, access_log=None, keepalive_timeout=api.idle_timeout_s,
                       max_connections=connection_cap(max_connections))
    await runner.setup()
    ssl_context = None if tls is None else tls.server_context(mutual=False)
    site = web.TCPSite(runner, host or "0.0.0.0", int(port), reuse_port=share_port or None, ssl_context=ssl_context)
    await site.start()
    return runner


def bound_port(runner: web.AppRunner) -> int:
    """The port an HTTP runner listens on."""
    for site in runner.sites:
        server = getattr(site, "_server", None)
        if server is not None and server.sockets:
            return server.sockets[0].getsockname()[1]
    raise RuntimeError("the HTTP server is not listening")
