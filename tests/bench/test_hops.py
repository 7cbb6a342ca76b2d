"""bench/hops.py: per-hop percentiles and per-request gaps from JSON-lines trace files."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

HOPS = Path(__file__).resolve().parents[2] / "bench" / "hops.py"
MS = 1_000_000


@pytest.fixture(scope="module")
def hops():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("bench_hops", HOPS)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def span(trace: str, span_id: str, parent: str | None, name: str, service: str, start_ms: float, end_ms: float) -> dict:
    return {"name": name, "service": service, "trace_id": trace, "span_id": span_id, "parent_span_id": parent,
            "start_ns": int(start_ms * MS), "end_ns": int(end_ms * MS), "attributes": {}}


def write(path: Path, spans: list[dict], tail: str = "") -> None:
    path.write_text("".join(json.dumps(s) + "\n" for s in spans) + tail)


def test_hops_in_timeline_order_with_percentiles_and_gaps(hops, tmp_path):
    gateway, prefill = [], []
    for index, (queue_ms, first_byte_ms) in enumerate([(1, 20), (3, 40)]):
        trace, base = f"{index:032x}", 1000 * index
        gateway += [span(trace, "a", "f" * 16, "cleave.v1.Gateway/Generate", "cleave-gateway", base, base + 50),
                    span(trace, "b", "a", "gateway.first_byte", "cleave-gateway", base + first_byte_ms, base + first_byte_ms)]
        prefill += [span(trace, "c", "a", "cleave.v1.Prefill/Prefill", "cleave-prefill", base + 2, base + 12),
                    span(trace, "d", "c", "engine.queue_wait", "cleave-prefill", base + 3, base + 3 + queue_ms),
                    span(trace, "e", "c", "engine.prefill_forward", "cleave-prefill", base + 3 + queue_ms, base + 10)]
    untraced = span("9" * 32, "z", None, "cleave.v1.Decode/GetLoad", "cleave-decode", 0, 1)
    write(tmp_path / "gateway.jsonl", gateway)
    write(tmp_path / "prefill-0.jsonl", prefill, tail='{"name": "cut sh')  # a killed writer's last line
    write(tmp_path / "decode-0.jsonl", [untraced])
    rows = hops.hop_table(tmp_path)
    assert [row["hop"] for row in rows] == [
        "cleave.v1.Gateway/Generate", "cleave.v1.Prefill/Prefill", "engine.queue_wait", "engine.prefill_forward",
        "gateway.first_byte", "gap: gateway receive -> first byte", "gap: gateway receive -> prefill receive",
        "gap: prefill forward end -> first byte",
    ]  # the lone GetLoad is no request's hop; no Decode/Start, so no gap that needs it
    by_hop = {row["hop"]: row for row in rows}
    queue_wait = by_hop["engine.queue_wait"]
    assert (queue_wait["count"], queue_wait["services"]) == (2, "prefill")
    assert queue_wait["p50_ms"] == pytest.approx(2.0) and queue_wait["p99_ms"] == pytest.approx(2.98)
    assert by_hop["engine.prefill_forward"]["start_p50_ms"] == pytest.approx(5.0)  # 4 and 6 ms in
    assert by_hop["gap: gateway receive -> first byte"]["p50_ms"] == pytest.approx(30.0)
    assert by_hop["gap: prefill forward end -> first byte"]["p99_ms"] == pytest.approx(29.8)
    json.dumps(rows)


def test_an_empty_directory_has_no_rows(hops, tmp_path):
    assert hops.hop_table(tmp_path) == []
    assert hops.main([str(tmp_path)]) == 1
