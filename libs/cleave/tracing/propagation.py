"""W3C trace context on the wire: `traceparent` / `tracestate` in gRPC metadata and HTTP
headers, read and written with OpenTelemetry's TraceContextTextMapPropagator.

A header that is present must parse: `check_traceparent` raises InvalidArgument naming it
(whether or not this process traces), so a client with a broken tracer hears about it
instead of silently losing its traces.
"""

from __future__ import annotations

import re

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from cleave.errors import InvalidArgument

TRACEPARENT = "traceparent"
TRACESTATE = "tracestate"
_EXAMPLE = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
# version-trace_id-parent_id-flags, lowercase hex; a version after 00 may append fields
_TRACEPARENT_RE = re.compile(r"([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(-.*)?")
_MAX_LENGTH = 512
_PROPAGATOR = TraceContextTextMapPropagator()


def check_traceparent(value: str) -> None:
    """Raise InvalidArgument (field `traceparent`) unless `value` is W3C trace context."""
    match = _TRACEPARENT_RE.fullmatch(value.strip(" \t")) if len(value) <= _MAX_LENGTH else None
    problem = None
    if match is None:
        problem = "does not parse"
    elif match.group(1) == "ff" or (match.group(1) == "00" and match.group(5)):
        problem = f"has an invalid version {match.group(1)!r}"
    elif match.group(2) == "0" * 32 or match.group(3) == "0" * 16:
        problem = "has an all-zero trace id or parent id"
    if problem is not None:
        raise InvalidArgument(
            f"the value {value[:80]!r} {problem} as W3C trace context; send "
            f"'00-<32 hex trace id>-<16 hex parent span id>-<2 hex flags>', e.g. {_EXAMPLE}, or leave it out",
            field=TRACEPARENT,
        )


def extract_context(traceparent: str | None, tracestate: str | None = None) -> Context:
    """A context whose (remote) span is the caller's; empty without a traceparent."""
    if traceparent is None:
        return Context()
    carrier = {TRACEPARENT: traceparent}
    if tracestate:
        carrier[TRACESTATE] = tracestate
    return _PROPAGATOR.extract(carrier)


def trace_headers(context: Context | None = None) -> dict[str, str]:
    """`traceparent` (and `tracestate`) of the span of `context` (default: current); empty
    when that span is not valid."""
    if not trace.get_current_span(context).get_span_context().is_valid:
        return {}
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier, context)
    return carrier


def traceparent_of(context: Context | None = None) -> str | None:
    """The `traceparent` value naming the span of `context` (default: current), or None."""
    return trace_headers(context).get(TRACEPARENT)
