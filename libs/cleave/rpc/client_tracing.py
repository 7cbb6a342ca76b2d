"""Client interceptors that carry the caller's trace context (`traceparent`, `tracestate`)
in the metadata of every call made on a `cleave.rpc.aio_channel`.

Outside a traced request they add nothing: one context lookup, then the call goes on as
it was. A caller that set `traceparent` itself keeps its own.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import grpc

from cleave.tracing import TRACEPARENT, current_context, trace_headers


def with_trace_context(details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
    """`details` with the current trace context added to its metadata (unchanged outside a
    traced request)."""
    context = current_context()
    if context is None:
        return details
    headers = trace_headers(context)
    metadata = tuple(details.metadata or ())
    if not headers or any(key == TRACEPARENT for key, _ in metadata):
        return details
    return details._replace(metadata=grpc.aio.Metadata(*metadata, *headers.items()))  # type: ignore[attr-defined]


Continuation = Callable[[grpc.aio.ClientCallDetails, Any], Awaitable[Any]]


class TraceUnaryUnary(grpc.aio.UnaryUnaryClientInterceptor):
    """Trace context on unary calls."""

    async def intercept_unary_unary(self, continuation: Continuation, client_call_details, request):  # type: ignore[no-untyped-def]
        return await continuation(with_trace_context(client_call_details), request)


class TraceUnaryStream(grpc.aio.UnaryStreamClientInterceptor):
    """Trace context on server-streaming calls."""

    async def intercept_unary_stream(self, continuation: Continuation, client_call_details, request):  # type: ignore[no-untyped-def]
        return await continuation(with_trace_context(client_call_details), request)


class TraceStreamUnary(grpc.aio.StreamUnaryClientInterceptor):
    """Trace context on client-streaming calls."""

    async def intercept_stream_unary(self, continuation: Continuation, client_call_details, request_iterator):  # type: ignore[no-untyped-def]
        return await continuation(with_trace_context(client_call_details), request_iterator)


class TraceStreamStream(grpc.aio.StreamStreamClientInterceptor):
    """Trace context on bidirectional calls."""

    async def intercept_stream_stream(self, continuation: Continuation, client_call_details, request_iterator):  # type: ignore[no-untyped-def]
        return await continuation(with_trace_context(client_call_details), request_iterator)


# grpc.aio files an interceptor under the first call type it implements, so one per type;
# they hold no state and are shared by every channel.
TRACE_INTERCEPTORS: tuple[grpc.aio.ClientInterceptor, ...] = (
    TraceUnaryUnary(), TraceUnaryStream(), TraceStreamUnary(), TraceStreamStream(),
)
