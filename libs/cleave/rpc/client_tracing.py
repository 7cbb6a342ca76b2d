"""Client interceptors that carry the caller's trace context (`traceparent`, `tracestate`)
in the metadata of every call made on a `cleave.rpc.aio_channel`.

Outside a traced request they add nothing: one context lookup, then the call goes on as
it was. A caller that set `traceparent` itself keeps its own.
"""

from __future__ import annotations

import grpc

from cleave.rpc.call_details import with_metadata
from cleave.tracing import TRACEPARENT, current_context, trace_headers


def with_trace_context(details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
    """`details` with the current trace context added to its metadata (unchanged outside a
    traced request, or when the caller set `traceparent` itself)."""
    context = current_context()
    if context is None:
        return details
    headers = trace_headers(context)
    if not headers or any(key == TRACEPARENT for key, _ in details.metadata or ()):
        return details
    return with_metadata(details, tuple(headers.items()))
