"""Errors of the HTTP API that aiohttp would answer itself, in OpenAI's error shape.

OpenAI clients parse `{"error": {"message", "type", "param", "code"}}` from every non-2xx
answer. aiohttp answers an unknown path or a wrong method in plain text; the
`json_routing_errors` middleware rewrites those answers (404 `not_found_error`, 405
`invalid_request_error`).

A request aiohttp cannot parse (a bad request line or header, a bad chunk size, a
Content-Encoding it has no decoder for) never reaches a middleware: aiohttp's connection
protocol answered it in plain text and logged the parser's traceback at ERROR, as it did
for a body that failed to decode once its handler had answered, so a client could flood
the logs. `AppRunner` serves the app on `OpenAIProtocol` connections, which answer such a
request with a 400 (a 415 with `Accept-Encoding` for a Content-Encoding it cannot decode)
and log one WARNING line without a traceback, naming what was wrong but not the request
bytes the parser's message quotes (a header's value may be a credential). aiohttp has no
public hook for these answers (aio-libs/aiohttp#3287): the protocol class is chosen in
`web.Server.__call__`, and `AppRunner._make_server` builds the server, as in every aiohttp
from 3.9 on.

`AppRunner` also caps the connections it holds (`max_connections`, from the open-file
limit by default: `cleave.rpc.connection_limits`). A connection past the cap gets a 503
in the same error shape, with `Retry-After`, before any request is read, then the
server's half of it is shut and the rest closed once the client closes or
`REFUSED_LINGER_S` passed (closing at once, with the request unread, would reset the
connection and could lose the answer). The count is of connections made, so a burst
accepted in one event-loop turn can pass the cap by up to asyncio's accept batch (100).
"""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any

import structlog
from aiohttp import web
from aiohttp.http_exceptions import ContentEncodingError, HttpProcessingError
from aiohttp.web_protocol import RequestPayloadError

from cleave.errors import CleaveError, InvalidArgument, Unavailable
from services.gateway.openai_request import BodyEncodingUnsupported, http_error

log = structlog.get_logger("cleave.gateway.http")
_MAX_REASON_CHARS = 200
REFUSED_LINGER_S = 2.0  # longest a refused connection stays open for its client to read the 503
_QUOTED_BYTES = re.compile(r"""(?:^|[\s:(]+)(?:bytearray\(|b?['"]|\^)""")  # where a parser message quotes the request


@web.middleware
async def json_routing_errors(request: web.Request, handler) -> web.StreamResponse:  # type: ignore[no-untyped-def]
    try:
        return await handler(request)
    except web.HTTPNotFound:
        return _error(404, "not_found_error", f"no route {request.method} {request.path}; "
                      "see GET /v1/models, POST /v1/completions, POST /v1/chat/completions")
    except web.HTTPMethodNotAllowed as error:
        allowed = ", ".join(sorted(error.allowed_methods))
        return _error(405, "invalid_request_error", f"{request.method} is not allowed on {request.path} "
                      f"(allowed: {allowed})", headers={"Allow": allowed})


def _error(status: int, error_type: str, message: str, headers: dict[str, str] | None = None) -> web.Response:
    body = {"error": {"message": message, "type": error_type, "param": None, "code": None}}
    return web.json_response(body, status=status, headers=headers)


def _parser_reason(error: BaseException) -> str:
    """What aiohttp's parser found wrong, without the request bytes its message quotes."""
    if not isinstance(error, HttpProcessingError) and isinstance(error.__cause__, HttpProcessingError):
        error = error.__cause__  # a RequestPayloadError, raised from the parser's error
    message = error.message if isinstance(error, HttpProcessingError) else str(error)
    parts = [_QUOTED_BYTES.split(line.strip(), maxsplit=1)[0].rstrip(":. ") for line in message.splitlines()]
    return ": ".join(part for part in parts if part)[:_MAX_REASON_CHARS] or type(error).__name__


def _client_error(error: HttpProcessingError) -> CleaveError:
    if isinstance(error, ContentEncodingError):  # raised with the head: a coding aiohttp has no decoder for
        return BodyEncodingUnsupported()
    return InvalidArgument(f"the HTTP request is malformed ({_parser_reason(error)})")


class OpenAIProtocol(web.RequestHandler):
    """aiohttp's HTTP/1 connection protocol, answering requests it cannot parse in OpenAI's
    error shape with one log line each (module docstring). A handler's own failure (5xx)
    is answered and logged as aiohttp does."""

    def handle_error(self, request: Any, status: int = 500, exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        if status >= 500 or not isinstance(exc, HttpProcessingError):
            return super().handle_error(request, status, exc, message)
        mapped = http_error(_client_error(exc), {})
        log.warning("malformed HTTP request", status=mapped.status, reason=_parser_reason(exc), peer=request.remote)
        response = web.json_response(mapped.body, status=mapped.status, headers=mapped.headers)
        response.force_close()  # the rest of the connection's bytes cannot be framed
        return response

    def log_exception(self, *args: Any, **kwargs: Any) -> None:
        error = kwargs.get("exc_info")
        if isinstance(error, RequestPayloadError):
            # a body that did not decode (answered 400 by its handler, or not read at all), met
            # again as aiohttp reads what is left of it after the answer
            peer = self.transport.get_extra_info("peername") if self.transport is not None else None
            log.warning("malformed HTTP request body", reason=_parser_reason(error), peer=peer[0] if peer else None)
            return
        super().log_exception(*args, **kwargs)


class _RefusedConnection(asyncio.Protocol):
    """A connection past the server's cap: the 503 written at once, the request never read."""

    def __init__(self, loop: asyncio.AbstractEventLoop, answer: bytes) -> None:
        self._loop = loop
        self._answer = answer
        self._close_handle: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        transport.write(self._answer)
        if transport.can_write_eof():
            transport.write_eof()  # FIN after the answer: the client reads it, then closes
        self._close_handle = self._loop.call_later(REFUSED_LINGER_S, transport.close)

    def data_received(self, data: bytes) -> None:
        pass  # the request: not read, only drained so the close is not a reset

    def eof_received(self) -> bool:
        return False  # the client closed its half: close the connection

    def connection_lost(self, exc: BaseException | None) -> None:
        if self._close_handle is not None:
            self._close_handle.cancel()


def refused_connection_answer(max_connections: int) -> bytes:
    """The whole HTTP/1.1 503 a connection past the cap gets (OpenAI's error shape)."""
    error = Unavailable(f"the server is at its limit of {max_connections} open HTTP connections; retry later, "
                        "or reuse a connection (keep-alive)")
    mapped = http_error(error, {})
    body = json.dumps(mapped.body).encode()
    head = [f"HTTP/1.1 {mapped.status} Service Unavailable", "Content-Type: application/json; charset=utf-8",
            f"Content-Length: {len(body)}", "Connection: close",
            *(f"{name}: {value}" for name, value in mapped.headers.items())]
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


class _Server(web.Server):
    """aiohttp's low-level server, making `OpenAIProtocol` connections up to `max_connections`
    open at once and `_RefusedConnection`s past it."""

    def __init__(self, *args: Any, max_connections: int, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.max_connections = max_connections
        self.open_connections = 0
        self._refusal = refused_connection_answer(max_connections)
        self._refusing = False  # one WARNING a stretch of refusals, not one a connection (a flood)

    def __call__(self) -> asyncio.Protocol:  # type: ignore[override]
        if self.open_connections >= self.max_connections:
            if not self._refusing:
                log.warning("HTTP connections refused until one closes: at the connection cap",
                            max_connections=self.max_connections)
            self._refusing = True
            return _RefusedConnection(self._loop, self._refusal)
        self._refusing = False
        return OpenAIProtocol(self, loop=self._loop, **self._kwargs)

    def connection_made(self, handler: web.RequestHandler, transport: asyncio.Transport) -> None:
        super().connection_made(handler, transport)
        self.open_connections += 1

    def connection_lost(self, handler: web.RequestHandler, exc: BaseException | None = None) -> None:
        if handler in self._connections:  # aiohttp calls this once per connection it made
            self.open_connections -= 1
        super().connection_lost(handler, exc)


class AppRunner(web.AppRunner):
    """`web.AppRunner` (same arguments, and `max_connections`) whose connections are
    `OpenAIProtocol`s, at most `max_connections` open at once."""

    def __init__(self, app: web.Application, *, max_connections: int, **kwargs: Any) -> None:
        super().__init__(app, **kwargs)
        self.max_connections = max_connections

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()  # the app started and frozen: its handler and request factory
        return _Server(server.request_handler, request_factory=server.request_factory,
                       handler_cancellation=server.handler_cancellation, max_connections=self.max_connections,
                       **server._kwargs)
