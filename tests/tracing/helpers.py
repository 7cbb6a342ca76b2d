"""Test doubles for tracing: a `Tracing` whose spans land in memory, and a traced caller."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from cleave.tracing import Tracing, TracingConfig, span
from cleave.tracing.spans import with_tracer


def memory_tracing(service_name: str) -> tuple[Tracing, InMemorySpanExporter]:
    """A Tracing that exports every span as it ends into the returned exporter."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider(resource=Resource.create({SERVICE_NAME: service_name}))
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return Tracing(TracingConfig(service_name=service_name), provider), exporter


@contextlib.contextmanager
def traced_caller(tracing: Tracing, name: str = "caller") -> Iterator[trace.Span]:
    """Run the block inside a root span of `tracing`, as code inside a traced request does."""
    assert tracing.tracer is not None
    token = otel_context.attach(with_tracer(tracing.tracer, Context()))
    try:
        with span(name) as root:
            yield root
    finally:
        otel_context.detach(token)


def by_name(spans: tuple[ReadableSpan, ...] | list[ReadableSpan], name: str) -> ReadableSpan:
    """The one finished span called `name`."""
    (found,) = [s for s in spans if s.name == name]
    return found
