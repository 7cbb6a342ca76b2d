"""The JSON-lines trace file: one object per span, with the ids and times bench/hops.py reads."""

from __future__ import annotations

import json

from cleave.tracing import TracingConfig, record_span, setup_tracing, span

CALLER = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


def test_spans_of_a_request_are_written_as_json_lines(tmp_path):
    path = tmp_path / "traces" / "decode-0.jsonl"  # the directory is created
    tracing = setup_tracing(TracingConfig(service_name="cleave-decode", trace_file=path))
    server_span = tracing.start_server_span("cleave.v1.Decode/Admit", CALLER, request_id="r1")
    with span("decode.first_step", tokens=2, ratio=0.5, ok=True):
        pass
    record_span("engine.queue_wait", 10, 20, request_id="r1")
    server_span.end(**{"rpc.grpc.status_code": "OK"})
    tracing.shutdown()  # flushes the batch
    records = {record["name"]: record for record in map(json.loads, path.read_text().splitlines())}
    assert set(records) == {"cleave.v1.Decode/Admit", "decode.first_step", "engine.queue_wait"}
    server = records["cleave.v1.Decode/Admit"]
    assert server["service"] == "cleave-decode" and server["kind"] == "SERVER"
    assert server["trace_id"] == "4bf92f3577b34da6a3ce929d0e0e4736"
    assert server["parent_span_id"] == "00f067aa0ba902b7"  # the caller's span
    assert server["attributes"] == {"request_id": "r1", "rpc.grpc.status_code": "OK"}
    assert server["status"] == "UNSET" and server["start_ns"] <= server["end_ns"]
    assert len(server["span_id"]) == 16
    child = records["decode.first_step"]
    assert child["parent_span_id"] == server["span_id"] and child["trace_id"] == server["trace_id"]
    assert child["attributes"] == {"tokens": 2, "ratio": 0.5, "ok": True}
    queue_wait = records["engine.queue_wait"]
    assert (queue_wait["start_ns"], queue_wait["end_ns"]) == (10, 20)
    assert queue_wait["parent_span_id"] == server["span_id"]


def test_a_failed_call_is_marked_error(tmp_path):
    path = tmp_path / "gateway.jsonl"
    tracing = setup_tracing(TracingConfig(service_name="cleave-gateway", trace_file=path))
    tracing.start_server_span("cleave.v1.Gateway/Generate", None).end(error="RESOURCE_EXHAUSTED")
    tracing.shutdown()
    (record,) = map(json.loads, path.read_text().splitlines())
    assert record["status"] == "ERROR" and record["parent_span_id"] is None  # a root span
