"""span / record_span / mark / current_context: children of the traced request, nothing off."""

from __future__ import annotations

import threading

from opentelemetry import trace

from cleave.tracing import (
    NOOP_SERVER_SPAN,
    NOOP_SPAN,
    TRACING_OFF,
    TracingConfig,
    annotate,
    current_context,
    mark,
    record_span,
    setup_tracing,
    span,
)
from tests.tracing.helpers import by_name, memory_tracing, traced_caller


def test_off_installs_nothing_and_every_helper_is_the_shared_noop(tmp_path):
    tracing = setup_tracing(TracingConfig(service_name="cleave-test"))
    assert not tracing.enabled and tracing.tracer is None
    assert isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider)  # no global provider
    assert span("a", x=1) is NOOP_SPAN and span("b") is NOOP_SPAN
    with span("a") as inside:
        assert inside is trace.INVALID_SPAN
    assert current_context() is None
    record_span("r", 1, 2)  # no error, nothing to record into
    mark("m")
    annotate(request_id="r")
    assert tracing.start_server_span("cleave.v1.X/Y", None) is NOOP_SERVER_SPAN
    assert TRACING_OFF.start_server_span("cleave.v1.X/Y", None) is NOOP_SERVER_SPAN
    tracing.shutdown()


def test_setting_up_tracing_leaves_the_global_provider_alone(tmp_path):
    tracing = setup_tracing(TracingConfig(service_name="cleave-test", trace_file=tmp_path / "t.jsonl"))
    assert tracing.enabled
    assert isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider)
    assert span("outside a request") is NOOP_SPAN  # no request, no tracer in the context
    tracing.shutdown()
    tracing.shutdown()  # twice is fine


def test_children_nest_under_the_request_span_and_keep_their_attributes():
    tracing, exporter = memory_tracing("cleave-test")
    with traced_caller(tracing) as root:
        with span("outer", request_id="r1", skipped=None) as outer:
            assert trace.get_current_span() is outer
            with span("inner"):
                mark("instant", tokens=3)
            annotate(extra="yes")
        assert trace.get_current_span() is root
    spans = exporter.get_finished_spans()
    root_span, outer_span, inner_span, instant = (by_name(spans, n) for n in ("caller", "outer", "inner", "instant"))
    assert {s.context.trace_id for s in spans} == {root_span.context.trace_id}
    assert outer_span.parent.span_id == root_span.context.span_id
    assert inner_span.parent.span_id == outer_span.context.span_id
    assert instant.parent.span_id == inner_span.context.span_id and instant.start_time == instant.end_time
    assert dict(outer_span.attributes) == {"request_id": "r1", "extra": "yes"}
    assert dict(instant.attributes) == {"tokens": 3}


def test_record_span_from_another_thread_uses_the_captured_context_and_times():
    tracing, exporter = memory_tracing("cleave-test")
    with traced_caller(tracing) as root:
        captured = current_context()
    assert captured is not None and current_context() is None

    def on_step_thread() -> None:
        assert current_context() is None  # the thread has no context of its own
        record_span("engine.step", 1_000, 5_000, captured, request_id="r2")

    thread = threading.Thread(target=on_step_thread)
    thread.start()
    thread.join()
    recorded = by_name(exporter.get_finished_spans(), "engine.step")
    assert (recorded.start_time, recorded.end_time) == (1_000, 5_000)
    assert recorded.parent.span_id == root.get_span_context().span_id
    assert recorded.context.trace_id == root.get_span_context().trace_id
    assert dict(recorded.attributes) == {"request_id": "r2"}
