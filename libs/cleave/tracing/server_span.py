"""`ServerSpan`: the SERVER span of one incoming call (gRPC) or request (HTTP).

It is started as a child of the caller's `traceparent` (a root span without one), becomes
the current context of the task that handles the call, with the tracer beside it so the
handler's `span`/`record_span` find it, and ends with the call's outcome.
"""

from __future__ import annotations

from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from cleave.tracing.propagation import extract_context
from cleave.tracing.spans import clean_attributes, with_tracer


class ServerSpan:
    """A started server span, current in the handling task until `end()`.

    Call `end()` from the task that started it (it restores that task's previous context).
    """

    def __init__(self, span: trace.Span, token: object) -> None:
        self._span = span
        self._token = token

    def end(self, error: str | None = None, **attributes: Any) -> None:
        """Set the outcome (`error`: a description, which marks the span failed) and end the
        span; later calls do nothing."""
        if self._token is None:
            return
        self._span.set_attributes(clean_attributes(attributes))
        if error is not None:
            self._span.set_status(Status(StatusCode.ERROR, error))
        otel_context.detach(self._token)  # type: ignore[arg-type]
        self._token = None
        self._span.end()


class _NoopServerSpan(ServerSpan):
    """What an untraced call gets: `end()` does nothing."""

    def __init__(self) -> None:
        super().__init__(trace.INVALID_SPAN, None)


NOOP_SERVER_SPAN: ServerSpan = _NoopServerSpan()


def start_server_span(
    tracer: trace.Tracer, name: str, traceparent: str | None, tracestate: str | None, **attributes: Any
) -> ServerSpan:
    """Start `name` as a SERVER span under the caller's trace context and make it current.

    The traceparent must already have passed `check_traceparent`.
    """
    parent = with_tracer(tracer, extract_context(traceparent, tracestate))
    started = tracer.start_span(name, context=parent, kind=SpanKind.SERVER, attributes=clean_attributes(attributes))
    token = otel_context.attach(trace.set_span_in_context(started, parent))
    return ServerSpan(started, token)
