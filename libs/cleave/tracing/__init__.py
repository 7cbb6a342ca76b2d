"""One trace per request across gateway, prefill, decode and kvstore (OpenTelemetry).

How a request's trace is put together:

    client --traceparent--> gateway: SERVER span (gRPC interceptor / HTTP middleware)
        gateway.tokenize, gateway.first_byte        (`span`)
        --traceparent--> prefill / decode / kvstore: SERVER span per call
            engine.queue_wait, engine.prefill_forward  (`record_span` from the step thread)

Each process calls `setup_tracing(config)` once in its `__main__`; the returned `Tracing`
holds the SDK TracerProvider and exporters (OTLP/HTTP to a collector and/or a JSON-lines file
that `bench/hops.py` reads). Nothing is installed globally: a server span puts its tracer
into the OpenTelemetry context next to the span, and `span`, `record_span` and
`current_context` take it from there. So with tracing off (no exporter configured) every
helper costs one context lookup and returns the shared `NOOP_SPAN`; outgoing gRPC calls
(`cleave.rpc.aio_channel`) carry the W3C `traceparent` of the current span only when one is
being recorded.
"""

from cleave.config import TracingConfig
from cleave.tracing.file_exporter import JsonLinesSpanExporter
from cleave.tracing.propagation import (
    TRACEPARENT,
    TRACESTATE,
    check_traceparent,
    extract_context,
    trace_headers,
    traceparent_of,
)
from cleave.tracing.server_span import NOOP_SERVER_SPAN, ServerSpan
from cleave.tracing.setup import TRACING_OFF, Tracing, setup_tracing
from cleave.tracing.spans import NOOP_SPAN, annotate, current_context, mark, record_span, span

__all__ = [
    "NOOP_SERVER_SPAN",
    "NOOP_SPAN",
    "TRACEPARENT",
    "TRACESTATE",
    "TRACING_OFF",
    "JsonLinesSpanExporter",
    "ServerSpan",
    "Tracing",
    "TracingConfig",
    "annotate",
    "check_traceparent",
    "current_context",
    "extract_context",
    "mark",
    "record_span",
    "setup_tracing",
    "span",
    "trace_headers",
    "traceparent_of",
]
