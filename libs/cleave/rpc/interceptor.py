"""The server interceptor every cleave service runs: request ids, traces, call logs, error mapping.

For each call it takes the `x-request-id` metadata (or makes one, also for an id over
`MAX_REQUEST_ID_CHARS`), binds it (and the method) into structlog's context variables for
every log line the call produces, checks the caller's
secret when the server asks for one (`cleave.rpc.auth`: UNAUTHENTICATED otherwise), starts the call's
SERVER span under the caller's `traceparent` (`cleave.tracing`; a malformed one fails the
call with INVALID_ARGUMENT naming it), runs the handler with that span current, maps a
raised exception to a real status code (`cleave.rpc.errors`; a unary request whose bytes do
not parse is INVALID_ARGUMENT naming `request`), returns the request id in the trailing
metadata, ends the span (a stream's when the stream ends) and logs one line with method,
status code and duration.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, NoReturn

import grpc
import structlog
from google.protobuf.message import DecodeError

from cleave.errors import InvalidArgument
from cleave.rpc.auth import MetadataAuth
from cleave.rpc.errors import map_exception
from cleave.rpc.method_handlers import responses_of, rewrap
from cleave.tracing import NOOP_SERVER_SPAN, TRACEPARENT, TRACESTATE, TRACING_OFF, Tracing

REQUEST_ID_KEY = "x-request-id"
MAX_REQUEST_ID_CHARS = 256  # a longer x-request-id is not taken (it would be echoed everywhere)
_QUIET_PREFIXES = ("/grpc.health.", "/grpc.reflection.")  # polled often: log at debug
# Codes that mark a server span failed (OpenTelemetry's gRPC conventions): the server's
# faults, not the caller's (INVALID_ARGUMENT, NOT_FOUND, CANCELLED...)
_SERVER_FAULTS = frozenset({
    grpc.StatusCode.UNKNOWN, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNIMPLEMENTED,
    grpc.StatusCode.INTERNAL, grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DATA_LOSS,
})
_request_id: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "cleave_request_id", default=None
)


def current_request_id() -> str | None:
    """The id of the RPC being handled by the current task, or None outside a call."""
    return _request_id.get()


class _Call:
    """Per-call state: ids, timing, and the outcome to log."""

    def __init__(
        self, method: str, request_id: str, trace_headers: tuple[str | None, str | None], tracing: Tracing,
        authenticate: Callable[[], None] = lambda: None,
    ) -> None:
        self.method = method
        self.authenticate = authenticate  # raises Unauthenticated; call inside the handler's try
        self.request_id = request_id
        self.started = time.perf_counter()
        quiet = method.startswith(_QUIET_PREFIXES)
        self.log = structlog.get_logger("cleave.rpc")
        self.log_level = "debug" if quiet else "info"
        self._trace_headers = trace_headers
        self._tracing = TRACING_OFF if quiet else tracing  # health polls make no spans
        self._span = NOOP_SERVER_SPAN

    def start_span(self) -> None:
        """Check the caller's traceparent (InvalidArgument when malformed) and make this
        call's server span current; call inside the handler's try."""
        traceparent, tracestate = self._trace_headers
        self._span = self._tracing.start_server_span(
            self.method.lstrip("/"), traceparent, tracestate, request_id=self.request_id
        )

    def _finish(self, context: grpc.aio.ServicerContext, code: grpc.StatusCode) -> None:
        trailing = tuple(context.trailing_metadata() or ())
        if not any(key == REQUEST_ID_KEY for key, _ in trailing):
            context.set_trailing_metadata((*trailing, (REQUEST_ID_KEY, self.request_id)))
        duration_ms = round((time.perf_counter() - self.started) * 1000, 3)
        level = self.log_level if code == grpc.StatusCode.OK else "warning"
        self._span.end(error=code.name if code in _SERVER_FAULTS else None, **{"rpc.grpc.status_code": code.name})
        getattr(self.log, level)("rpc", code=code.name, duration_ms=duration_ms)

    def succeeded(self, context: grpc.aio.ServicerContext) -> None:
        self._finish(context, grpc.StatusCode.OK)

    async def failed(self, exc: BaseException, context: grpc.aio.ServicerContext) -> NoReturn:
        if isinstance(exc, grpc.aio.AbortError):  # the servicer set the status itself
            self._finish(context, context.code() or grpc.StatusCode.UNKNOWN)
            raise exc
        if isinstance(exc, (asyncio.CancelledError, GeneratorExit)) or _cancelled():
            # After a cancel (the caller went away, or the server stops) a handler that ran its
            # cleanup to the end may fail on a write to the finished call (grpc's
            # ExecuteBatchError): that is the cancel, not a bug to log with a traceback.
            if not isinstance(exc, (asyncio.CancelledError, GeneratorExit)):
                self.log.info("rpc handler failed after its call was cancelled", error=repr(exc))
            self._finish(context, grpc.StatusCode.CANCELLED)
            raise exc
        mapped = map_exception(exc, self.request_id)
        if mapped.is_bug:
            self.log.exception("rpc handler failed", exc_info=exc)
        context.set_trailing_metadata(mapped.trailing_metadata())
        self._finish(context, mapped.code)
        await context.abort(mapped.code, mapped.message)
        raise AssertionError("context.abort returned")  # pragma: no cover

    def bind(self) -> Any:
        _request_id.set(self.request_id)
        return structlog.contextvars.bound_contextvars(
            request_id=self.request_id, rpc=self.method
        )


def _cancelled() -> bool:
    """Whether the task running the handler was cancelled (the handler may have gone on)."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


class _Undecodable:
    """A request whose bytes did not parse (corrupt wire format, a string that is not
    UTF-8): the handler answers INVALID_ARGUMENT after authenticating the caller, instead of
    grpc's UNKNOWN from a deserializer that raised."""

    def __init__(self, error: DecodeError) -> None:
        self.error = error

    def check(self) -> None:
        raise InvalidArgument(f"the request message does not parse ({self.error})", field="request")


def _tolerant(deserializer: Callable[[bytes], Any] | None) -> Callable[[bytes], Any] | None:
    if deserializer is None:
        return None

    def deserialize(data: bytes) -> Any:
        try:
            return deserializer(data)
        except DecodeError as error:
            return _Undecodable(error)

    return deserialize


def _metadata_value(metadata: Any, key: str) -> str | None:
    value = next((value for name, value in metadata if name == key), None)
    return None if value is None else str(value)


def _unary_response(behavior: Callable[..., Awaitable[Any]], call_for: Callable[[], _Call]):
    async def handler(request: Any, context: grpc.aio.ServicerContext) -> Any:
        call = call_for()
        with call.bind():
            try:
                call.authenticate()
                call.start_span()
                if isinstance(request, _Undecodable):
                    request.check()
                response = await behavior(request, context)
            except BaseException as exc:  # noqa: BLE001 - mapped to a status, then re-raised
                await call.failed(exc, context)
            call.succeeded(context)
            return response

    return handler


def _stream_response(behavior: Callable[..., Any], call_for: Callable[[], _Call]):
    async def handler(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        call = call_for()
        with call.bind():
            try:
                call.authenticate()
                call.start_span()
                if isinstance(request, _Undecodable):
                    request.check()
                async with contextlib.aclosing(responses_of(behavior(request, context))) as responses:
                    async for response in responses:
                        yield response
            except BaseException as exc:  # noqa: BLE001 - mapped to a status, then re-raised
                await call.failed(exc, context)
            call.succeeded(context)

    return handler


class RequestInterceptor(grpc.aio.ServerInterceptor):
    """Binds request ids, traces and logs every call and maps exceptions to status codes.

    Args:
        tracing: where server spans go (`cleave.tracing.setup_tracing`); off by default.
        auth: the secret every call but health and reflection must carry (`cleave.rpc.auth`);
            None: calls are not authenticated.
    """

    def __init__(self, tracing: Tracing = TRACING_OFF, auth: MetadataAuth | None = None) -> None:
        self.tracing = tracing
        self.auth = auth

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        method = handler_call_details.method
        metadata = handler_call_details.invocation_metadata or ()
        request_id = str(next((value for key, value in metadata if key == REQUEST_ID_KEY), ""))
        if not request_id or len(request_id) > MAX_REQUEST_ID_CHARS:
            request_id = uuid.uuid4().hex
        trace_headers = (_metadata_value(metadata, TRACEPARENT), _metadata_value(metadata, TRACESTATE))
        tracing = self.tracing
        auth = self.auth

        def authenticate() -> None:
            if auth is not None:
                auth.check(method, metadata)

        def call_for() -> _Call:
            return _Call(method, request_id, trace_headers, tracing, authenticate)

        return rewrap(handler, lambda behavior: _unary_response(behavior, call_for),
                      lambda behavior: _stream_response(behavior, call_for),
                      single_request_deserializer=_tolerant(handler.request_deserializer))
