"""Child spans inside a traced request: `span` (a block of code), `record_span` (work timed
elsewhere, e.g. on the engine's step thread), `mark` (an instant), `annotate` (attributes of
the current span) and `current_context` (to hand a request's context to another thread).

The tracer travels in the OpenTelemetry context under `TRACER_KEY`, put there with the
request's server span (`cleave.tracing.server_span`). No tracer in the context means the
code does not run inside a traced request (or tracing is off): every helper then returns
after that one lookup.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Mapping
from typing import Any, ContextManager

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.util.types import AttributeValue

TRACER_KEY = otel_context.create_key("cleave-tracer")
# What `span` returns outside a traced request; entering it yields the invalid span, whose
# setters do nothing. Stateless, so one instance serves every caller and thread.
NOOP_SPAN: ContextManager[trace.Span] = contextlib.nullcontext(trace.INVALID_SPAN)


def with_tracer(tracer: trace.Tracer, context: Context) -> Context:
    """`context` carrying `tracer` for the helpers below (server spans set it)."""
    return otel_context.set_value(TRACER_KEY, tracer, context)


def _tracer(context: Context | None) -> trace.Tracer | None:
    # a Context is a read-only dict: one lookup, the whole cost of the helpers when off
    return (otel_context.get_current() if context is None else context).get(TRACER_KEY)  # type: ignore[return-value]


def clean_attributes(attributes: Mapping[str, Any]) -> dict[str, AttributeValue]:
    """OpenTelemetry takes str, bool, int, float (and sequences of them); None is dropped."""
    return {key: value for key, value in attributes.items() if value is not None}


def span(name: str, **attributes: Any) -> ContextManager[trace.Span]:
    """A context manager timing its block as a child span of the current span, current
    inside the block (also across awaits of the same task). Outside a traced request it is
    the shared `NOOP_SPAN`."""
    tracer = _tracer(None)
    if tracer is None:
        return NOOP_SPAN
    return tracer.start_as_current_span(name, attributes=clean_attributes(attributes))


def record_span(name: str, start_ns: int, end_ns: int, parent: Context | None = None, **attributes: Any) -> None:
    """Record a finished span with explicit wall-clock times (`time.time_ns()`), as a child
    of `parent` (a context from `current_context()`, possibly of another thread) or of the
    current context. Safe to call from any thread; does nothing without a traced parent."""
    tracer = _tracer(parent)
    if tracer is None:
        return
    recorded = tracer.start_span(name, context=parent, start_time=start_ns, attributes=clean_attributes(attributes))
    recorded.end(end_time=end_ns)


def mark(name: str, **attributes: Any) -> None:
    """Record an instant (a zero-length child span of the current span), e.g. the moment a
    response's first bytes are handed out; nothing outside a traced request."""
    tracer = _tracer(None)
    if tracer is None:
        return
    now = time.time_ns()
    tracer.start_span(name, start_time=now, attributes=clean_attributes(attributes)).end(end_time=now)


def current_context() -> Context | None:
    """The current context when it belongs to a traced request (to pass to `record_span` on
    another thread), else None."""
    context = otel_context.get_current()
    return context if context.get(TRACER_KEY) is not None else None


def annotate(**attributes: Any) -> None:
    """Set attributes on the current span of a traced request (e.g. an id known only once
    the handler has parsed the request); nothing otherwise."""
    if _tracer(None) is None:
        return
    trace.get_current_span().set_attributes(clean_attributes(attributes))
