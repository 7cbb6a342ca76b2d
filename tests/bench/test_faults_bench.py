"""bench/faults.py --quick end to end: a supervised process stack loses no request to a killed,
drained or hung (SIGSTOPped) service, leaks no KV block, and refuses oversized input; the
result files record the command and every figure."""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.mark.timeout(400)  # a guard against a hang; about a minute on two cores
def test_quick_run_loses_nothing_and_leaks_nothing(monkeypatch, tmp_path):
    monkeypatch.syspath_prepend(str(BENCH))  # faults imports its bench/ neighbour common
    faults = importlib.import_module("faults")
    results = faults.main(["--quick", "--out", str(tmp_path)])

    kill = results["kill"]
    assert kill["requests"] == faults.QUICK.num_requests
    assert kill["completed"] == kill["identical"] == kill["requests"], kill
    assert kill["exit"] == -9 and kill["came_back"] and kill["took_traffic"], kill

    assert [drained["service"] for drained in results["drain"]] == list(faults.DRAINED)
    for drained in results["drain"]:
        assert drained["in_flight"] > 0 and drained["admitted_lost"] == 0, drained
        assert drained["exit"] == 0 and drained["restarted"], drained

    assert [hung["service"] for hung in results["hang"]] == list(faults.HUNG)
    for hung in results["hang"]:  # a stopped worker's requests move on once it is lost
        assert hung["completed"] == hung["identical"] == hung["requests"], hung
        assert hung["serving_again"], hung

    mixed = results["mixed"]
    assert sum(mixed["outcomes"].values()) == faults.QUICK.num_mixed
    assert set(mixed["outcomes"]) <= {"finished", "cancelled", "timed out"}, mixed
    assert mixed["outcomes"].get("cancelled", 0) > 0 and mixed["outcomes"].get("finished", 0) > 0, mixed
    assert mixed["blocks_leaked"] == 0 and mixed["still_running"] == 0, mixed

    attack = results["oversized"]
    assert set(attack["attacks"]) == {"http_content_length", "http_chunked", "grpc_message"}
    for kind, runs in attack["attacks"].items():
        assert runs["statuses"] == (["RESOURCE_EXHAUSTED"] if kind == "grpc_message"
                                    else ["HTTP/1.1 413 Request Entity Too Large"]), (kind, runs)
    # how much of the body left the client before the 413 depends on socket buffers, and how
    # fast the refusal came on the machine's load: both are the benchmark's figures, not checked here
    assert attack["rss_growth_mb"] < 100, attack
    assert attack["itl_p99_quiet_ms"] is not None and attack["itl_p99_attacked_ms"] is not None

    json_path, md_path = map(Path, results["files"])
    saved = json.loads(json_path.read_text())
    assert "--quick" in saved["command"] and saved["machine"]["date"]
    assert saved["summary"]["kill"] == kill and saved["rows"] == results["rows"]
    assert "| part | figure | value | target | met |" in md_path.read_text()
