"""One aiohttp session against an OpenAI-compatible server: a `BenchRequest` in, a timed
`RequestRecord` out.

Every request streams (`stream: true`) and asks for usage in the last chunk
(`stream_options.include_usage`); servers that ignore that are counted by chunks. Output
lengths are pinned with `max_tokens` plus `min_tokens` and `ignore_eos` (vLLM's and SGLang's
extensions); `check_endpoint` drops the two when the server refuses them. Failures never
raise out of `send`: they become the record's error, so one bad request does not end a run.
"""

from __future__ import annotations

import asyncio
import json
import re
import ssl
import time
from dataclasses import dataclass, replace
from typing import Any

import aiohttp

from cleave.benchmark.records import RequestRecord
from cleave.benchmark.sse import SSEParser
from cleave.benchmark.workload import BenchRequest

_MAX_MESSAGE_CHARS = 200
_PROBE_OUTPUT_TOKENS = 4
_LENGTH_EXTENSIONS = ("ignore_eos", "min_tokens")


class EndpointError(Exception):
    """The server cannot be benchmarked as given (unreachable, wrong path, not OpenAI-shaped,
    refused credentials); the message is one line that says what to fix."""


@dataclass(frozen=True)
class EndpointSpec:
    """Where and how to send requests.

    base_url is scheme://host:port (with any path prefix before /v1); endpoint the route,
    `/v1/completions` or `/v1/chat/completions`; model None leaves `model` out of the body;
    ignore_eos sends `ignore_eos` and `min_tokens` so every request produces its full length;
    ca_file: the CA an https server is checked against (None: the system's roots).
    """

    base_url: str
    endpoint: str = "/v1/completions"
    model: str | None = None
    api_key: str | None = None
    ignore_eos: bool = True
    temperature: float = 0.0
    request_timeout_s: float = 600.0
    ca_file: str | None = None

    def ssl_context(self) -> ssl.SSLContext | bool:
        """What the session checks an https server with: the CA's context, or True (the
        system's roots)."""
        return True if self.ca_file is None else ssl.create_default_context(cafile=self.ca_file)

    @property
    def url(self) -> str:
        return self.base_url.rstrip("/") + "/" + self.endpoint.lstrip("/")

    @property
    def is_chat(self) -> bool:
        return self.endpoint.rstrip("/").endswith("chat/completions")

    def headers(self) -> dict[str, str]:
        headers = {"User-Agent": "cleave-bench-serve"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        return headers

    def payload(self, request: BenchRequest) -> dict[str, Any]:
        body: dict[str, Any] = {"stream": True, "stream_options": {"include_usage": True},
                                "temperature": self.temperature}
        if self.model is not None:
            body["model"] = self.model
        if self.is_chat:
            body["messages"] = [{"role": "user", "content": request.prompt}]
            body["max_completion_tokens"] = request.output_len
        else:
            body["prompt"] = request.prompt
            body["max_tokens"] = request.output_len
        if self.ignore_eos:
            body["ignore_eos"] = True
            body["min_tokens"] = request.output_len
        return body


def one_line(text: str) -> str:
    text = re.sub(r"\s+", " ", text).strip()
    return text if len(text) <= _MAX_MESSAGE_CHARS else text[:_MAX_MESSAGE_CHARS - 3] + "..."


def error_message(body: str) -> str:
    """The message of an error body: OpenAI's `{"error": {"message"}}`, vLLM's older
    `{"message"}`, else the text itself."""
    try:
        parsed = json.loads(body)
    except ValueError:
        return one_line(body) or "(empty body)"
    if isinstance(parsed, dict):
        error = parsed.get("error")
        if isinstance(error, dict) and isinstance(error.get("message"), str):
            return one_line(error["message"])
        if isinstance(error, str):
            return one_line(error)
        if isinstance(parsed.get("message"), str):
            return one_line(parsed["message"])
        if isinstance(parsed.get("detail"), str):
            return one_line(parsed["detail"])
    return one_line(body)


class _Stream:
    """Folds a response's events into a record's timings and counts."""

    def __init__(self, record: RequestRecord, sent: float) -> None:
        self.record = record
        self.sent = sent
        self.last_token_at: float | None = None
        self.token_chunks = 0
        self.done = False
        self.openai_shaped = False
        self.error: str | None = None

    def event(self, data: str, now: float) -> None:
        if data.strip() == "[DONE]":
            self.done = True
            return
        try:
            payload = json.loads(data)
        except ValueError:
            self.error = self.error or f"an event that is not JSON: {one_line(data)}"
            return
        if not isinstance(payload, dict):
            self.error = self.error or f"an event that is not a JSON object: {one_line(data)}"
            return
        if "error" in payload:
            self.error = self.error or error_message(data)
            return
        usage = payload.get("usage")
        if isinstance(usage, dict):
            self.openai_shaped = True
            if isinstance(usage.get("completion_tokens"), int):
                self.record.output_tokens = usage["completion_tokens"]
                self.record.usage_reported = True
            if isinstance(usage.get("prompt_tokens"), int):
                self.record.prompt_len = usage["prompt_tokens"]
        choices = payload.get("choices")
        if not isinstance(choices, list):
            return
        self.openai_shaped = True
        for choice in choices:
            if isinstance(choice, dict) and choice.get("finish_reason"):
                self.record.finish_reason = str(choice["finish_reason"])
        # as in vLLM's benchmark, every chunk with a choice is a token's arrival: a token
        # without text of its own (a reasoning marker, half a character) still streams a chunk
        if choices:
            self.token_chunks += 1
            if self.last_token_at is None:
                self.record.ttft_s = now - self.sent
            else:
                self.record.itl_s.append(now - self.last_token_at)
            self.last_token_at = now


class OpenAIClient:
    """Sends `BenchRequest`s over one aiohttp session (opened and closed by `async with`)."""

    def __init__(self, spec: EndpointSpec, max_connections: int = 0) -> None:
        self.spec = spec
        self.max_connections = max_connections
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> "OpenAIClient":
        connector = aiohttp.TCPConnector(limit=self.max_connections, limit_per_host=self.max_connections,
                                         keepalive_timeout=60, ssl=self.spec.ssl_context())
        self._session = aiohttp.ClientSession(connector=connector, headers=self.spec.headers(),
                                              timeout=aiohttp.ClientTimeout(total=self.spec.request_timeout_s))
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            raise RuntimeError("use the client inside `async with`")
        return self._session

    async def send(self, request: BenchRequest, index: int = 0, run_start: float | None = None) -> RequestRecord:
        """Send one request and time it (never raises for the server's or network's faults)."""
        sent = time.perf_counter()
        record = RequestRecord(index=index, sent_s=sent - (sent if run_start is None else run_start),
                               prompt_len=request.prompt_len, output_len=request.output_len)
        try:
            async with self.session.post(self.spec.url, json=self.spec.payload(request)) as response:
                record.status = response.status
                if response.status != 200:
                    return _failed(record, f"HTTP {response.status}", error_message(await response.text()))
                content_type = response.headers.get("Content-Type", "")
                if not content_type.startswith("text/event-stream"):
                    body = one_line(await response.text())
                    return _failed(record, "protocol", f"answered {content_type or 'no Content-Type'} instead of "
                                                       f"an event stream: {body}")
                stream = _Stream(record, sent)
                parser = SSEParser()
                async for chunk in response.content.iter_any():
                    now = time.perf_counter()
                    for data in parser.feed(chunk):
                        stream.event(data, now)
                for data in parser.close():
                    stream.event(data, time.perf_counter())
            record.e2e_s = time.perf_counter() - sent
        except asyncio.TimeoutError:
            return _failed(record, "timeout", f"no complete answer within {self.spec.request_timeout_s:g} s")
        except aiohttp.ClientConnectorError as error:
            return _failed(record, "connection", one_line(str(error.os_error) or str(error)))
        except aiohttp.ClientResponseError as error:  # raised by the parser: not HTTP/1.x at all
            return _failed(record, "protocol", _not_http(error))
        except aiohttp.ClientError as error:
            return _failed(record, "connection", one_line(f"{type(error).__name__}: {error}"))
        if stream.error is not None:
            return _failed(record, "stream error", stream.error)
        if not stream.openai_shaped:
            return _failed(record, "protocol", "the event stream held no OpenAI completion chunks")
        if not stream.done:
            return _failed(record, "stream error", "the stream ended before its `data: [DONE]`")
        if not record.usage_reported:
            record.output_tokens = stream.token_chunks
        record.success = True
        return record

    async def served_models(self) -> list[tuple[str, str | None]]:
        """(id, root) of each model GET /v1/models lists (`root`: vLLM's and cleave's
        checkpoint path); [] when the server has no such route or answers it oddly.

        Raises:
            EndpointError: the server is unreachable or refuses the credentials.
        """
        url = self.spec.base_url.rstrip("/") + "/v1/models"
        try:
            async with self.session.get(url) as response:
                if response.status in (401, 403):
                    raise EndpointError(_refused(url, response.status, error_message(await response.text()), self.spec))
                if response.status != 200:
                    return []
                try:
                    listing = await response.json(content_type=None)
                except ValueError:
                    return []
        except asyncio.TimeoutError:
            raise EndpointError(f"{url} did not answer within {self.spec.request_timeout_s:g} s") from None
        except aiohttp.ClientResponseError as error:
            raise EndpointError(f"{url} did not answer like an OpenAI-compatible server: {_not_http(error)}") from None
        except aiohttp.ClientError as error:
            raise EndpointError(_unreachable(url, error)) from None
        models = listing.get("data") if isinstance(listing, dict) else None
        if not isinstance(models, list):
            return []
        return [(m["id"], m.get("root") if isinstance(m.get("root"), str) else None)
                for m in models if isinstance(m, dict) and isinstance(m.get("id"), str)]


@dataclass(frozen=True)
class EndpointCheck:
    """What `check_endpoint` found: the spec that works, a note for the user (None: nothing
    to say) and how many requests it sent (servers count them; the run's records do not)."""

    spec: EndpointSpec
    note: str | None
    requests_sent: int


async def check_endpoint(client: OpenAIClient, request: BenchRequest) -> EndpointCheck:
    """Send one short request before the run and set `client.spec` to the spec that works
    (without `ignore_eos`/`min_tokens` when the server refuses them).

    Raises:
        EndpointError: one line naming the URL and what to fix.
    """
    probe = replace(request, output_len=min(request.output_len, _PROBE_OUTPUT_TOKENS))
    record = await client.send(probe)
    note, sent = None, 1
    if (not record.success and record.status == 400 and client.spec.ignore_eos
            and any(name in (record.error or "") for name in _LENGTH_EXTENSIONS)):
        client.spec = replace(client.spec, ignore_eos=False)
        note = (f"the server refused ignore_eos/min_tokens ({record.error}); sending max_tokens only, "
                "so outputs may end early")
        record = await client.send(probe)
        sent += 1
    if record.success:
        return EndpointCheck(client.spec, note, sent)
    url, reason, message = client.spec.url, record.error_reason, record.error
    if reason == "connection":
        raise EndpointError(f"cannot reach {url}: {message}; is the server running and --base-url right?")
    if reason == "timeout":
        raise EndpointError(f"{url}: {message}")
    if record.status in (401, 403):
        raise EndpointError(_refused(url, record.status, message or "", client.spec))
    if record.status in (404, 405):
        raise EndpointError(f"{url} answered HTTP {record.status} ({message}): no OpenAI route there; check "
                            "--base-url and --endpoint (/v1/completions or /v1/chat/completions)")
    if reason == "protocol":
        raise EndpointError(f"{url} did not answer like an OpenAI-compatible server: {message}")
    raise EndpointError(f"{url} refused the first request ({reason}): {message}")


def _failed(record: RequestRecord, reason: str, message: str) -> RequestRecord:
    record.success = False
    record.error_reason = reason
    record.error = message
    return record


def _refused(url: str, status: int, message: str, spec: EndpointSpec) -> str:
    fix = "the --api-key given was refused" if spec.api_key else "pass the server's key with --api-key"
    return f"{url} answered HTTP {status} ({message}): {fix}"


def _not_http(error: aiohttp.ClientResponseError) -> str:
    first_line = str(error.message).split("\n", 1)[0]
    return f"the answer is not HTTP/1.1 ({one_line(first_line)}); is that the server's HTTP port (not gRPC)?"


def _unreachable(url: str, error: aiohttp.ClientError) -> str:
    detail = error.os_error if isinstance(error, aiohttp.ClientConnectorError) else error
    return f"cannot reach {url}: {one_line(str(detail) or type(error).__name__)}; is the server running and --base-url right?"
