"""The stack as processes with `StackSpec.trace_dir`: one request is one trace across gateway,
prefill, decode (and kvstore), and bench/hops.py reads its hops back."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import httpx
import pytest

from cleave.cli._stack import ProcessStack, StackSpec
from cleave.client import GatewayClient
from tests.e2e.conftest import NUM_KV_BLOCKS, START_HANG_S

CALLER = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
HOPS = Path(__file__).resolve().parents[2] / "bench" / "hops.py"


def load_hops():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("bench_hops", HOPS)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


@pytest.fixture(scope="module")
def traced_stack(e2e_model, tmp_path_factory):
    """A disaggregated stack whose services write <trace_dir>/<name>.jsonl; yields the stack
    while it runs, then (after `stop` flushed the spans) the trace directory is complete."""
    workdir = tmp_path_factory.mktemp("traced-stack")
    spec = StackSpec(model=e2e_model, grpc_port=0, http_port=0, num_kv_blocks=NUM_KV_BLOCKS, log_level="WARNING",
                     trace_dir=workdir / "traces")
    stack = ProcessStack(spec, workdir)
    stack.start(timeout_s=START_HANG_S)
    try:
        yield stack
    finally:
        stack.stop()


@pytest.mark.timeout(600)
async def test_a_request_is_one_trace_across_the_services(traced_stack):
    async with GatewayClient(traced_stack.gateway_address) as client:
        async for _ in client.generate("Tell me about tracing across services", max_tokens=4, temperature=0.0):
            pass
    async with httpx.AsyncClient() as http:
        refused = await http.post(f"{traced_stack.http_url}/completions", headers={"traceparent": "nonsense"},
                                  json={"prompt": "hi", "max_tokens": 2})
        streamed = await http.post(f"{traced_stack.http_url}/completions", headers={"traceparent": CALLER},
                                   json={"prompt": "hello there", "max_tokens": 2, "stream": True})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "traceparent"
    assert streamed.status_code == 200
    traced_stack.stop()  # the services flush their spans on the way out
    trace_dir = traced_stack.spec.trace_dir
    assert {path.name for path in trace_dir.glob("*.jsonl")} >= {"gateway.jsonl", "prefill-0.jsonl", "decode-0.jsonl"}
    hops = load_hops()
    spans = hops.read_spans(trace_dir)
    traces = hops.group_traces(spans)
    # the HTTP request continues the caller's trace; find the gRPC request's trace by its root
    http_trace = traces["4bf92f3577b34da6a3ce929d0e0e4736"]
    grpc_trace = next(t for t in traces.values() if hops.trace_root(t)["name"] == "cleave.v1.Gateway/Generate")
    for trace_spans in (grpc_trace, http_trace):
        names = {span["name"]: span for span in trace_spans}
        assert {"gateway.tokenize", "gateway.first_byte", "cleave.v1.Prefill/Prefill", "engine.queue_wait",
                "engine.prefill_forward", "prefill.first_tokens"} <= set(names), sorted(names)
        # the first tokens leave the prefill worker before its KV does, and reach the client after
        assert names["prefill.first_tokens"]["start_ns"] <= names["prefill.kv_send"]["start_ns"]
        assert names["prefill.first_tokens"]["start_ns"] <= names["gateway.first_byte"]["start_ns"]
        assert any(name.startswith("cleave.v1.Decode/") for name in names)
        assert {span["service"] for span in trace_spans} >= {"cleave-gateway", "cleave-prefill", "cleave-decode"}
        by_id = {span["span_id"]: span for span in trace_spans}
        # the prefill server span hangs under a gateway span; the engine spans under it
        prefill = names["cleave.v1.Prefill/Prefill"]
        assert by_id[prefill["parent_span_id"]]["service"] == "cleave-gateway"
        assert names["engine.prefill_forward"]["parent_span_id"] == prefill["span_id"]
    assert hops.trace_root(http_trace)["parent_span_id"] == "00f067aa0ba902b7"
    rows = {row["hop"]: row for row in hops.hop_table(trace_dir)}
    assert rows["gap: gateway receive -> first byte"]["count"] == 2
    assert rows["gap: first tokens out -> first byte"]["count"] == 2
    assert rows["engine.prefill_forward"]["p50_ms"] > 0
    json.dumps(list(rows.values()))  # what bench/disagg.py stores under "hops"
