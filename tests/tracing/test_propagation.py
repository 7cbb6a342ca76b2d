"""W3C traceparent: what parses, what is refused (naming the header), and round trips."""

from __future__ import annotations

import pytest
from opentelemetry import trace

from cleave.errors import InvalidArgument
from cleave.tracing import check_traceparent, extract_context, trace_headers, traceparent_of
from tests.tracing.helpers import memory_tracing, traced_caller

VALID = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


@pytest.mark.parametrize("value", [VALID, "01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00-future",
                                   f" {VALID}\t"])
def test_valid_traceparents_pass(value):
    check_traceparent(value)


@pytest.mark.parametrize("value", [
    "",
    "garbage",
    VALID.upper(),                                                 # hex must be lowercase
    "00-4bf92f3577b34da6a3ce929d0e0e473-00f067aa0ba902b7-01",      # 31-digit trace id
    "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b-01",      # 15-digit parent id
    "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",     # forbidden version
    f"{VALID}-extra",                                              # version 00 has no more fields
    "00-00000000000000000000000000000000-00f067aa0ba902b7-01",     # all-zero trace id
    "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",     # all-zero parent id
    VALID + "-" + "x" * 600,                                       # over the length limit
])
def test_malformed_traceparents_are_refused_naming_the_header(value):
    with pytest.raises(InvalidArgument) as raised:
        check_traceparent(value)
    assert raised.value.field == "traceparent"
    assert str(raised.value).startswith("traceparent: ")
    assert "00-<32 hex trace id>" in raised.value.message


def test_extracted_context_names_the_remote_parent():
    span_context = trace.get_current_span(extract_context(VALID, "vendor=1")).get_span_context()
    assert span_context.is_remote and span_context.trace_flags.sampled
    assert (span_context.trace_id, span_context.span_id) == (0x4BF92F3577B34DA6A3CE929D0E0E4736, 0x00F067AA0BA902B7)
    assert span_context.trace_state.get("vendor") == "1"
    assert trace.get_current_span(extract_context(None)) is trace.INVALID_SPAN


def test_headers_of_the_current_span_round_trip():
    assert trace_headers() == {} and traceparent_of() is None  # no span, nothing to send
    tracing, _ = memory_tracing("cleave-test")
    with traced_caller(tracing) as root:
        value = traceparent_of()
    check_traceparent(value)
    parent = trace.get_current_span(extract_context(value)).get_span_context()
    assert (parent.trace_id, parent.span_id) == (root.get_span_context().trace_id, root.get_span_context().span_id)
