"""bench/soak.py end to end on the CPU at tiny sizes: three rounds of 20 requests of every kind
(gRPC and the real OpenAI client) against the supervised process stack. The result files hold
a row per round per service, each service's growth, how every request ended (none in an
error) and the KV blocks leaked (none)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SERVICES = ["gateway", "prefill-0", "prefill-1", "decode-0", "decode-1", "kvstore"]
KINDS = {"finish", "cancel_early", "cancel_streaming", "timeout", "chat_stream", "completions_n", "logprobs", "stop",
         "guided_regex", "stream_closed"}


@pytest.mark.timeout(300)  # a guard against a hang; about 20 s on two cores
def test_a_short_run_writes_a_row_per_round_per_service(tmp_path):
    out = tmp_path / "out"
    command = [sys.executable, str(ROOT / "bench" / "soak.py"), "--rounds", "3", "--requests", "20", "--out", str(out)]
    finished = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert finished.returncode == 0, finished.stderr[-3000:]
    (result,) = out.glob("soak-*.json")
    saved = json.loads(result.read_text())

    rows = saved["rows"]
    assert [(row["round"], row["service"]) for row in rows] == [
        (round_number, service) for round_number in (1, 2, 3) for service in SERVICES]
    assert [row["requests"] for row in rows[::len(SERVICES)]] == [20, 40, 60]
    assert all(row["rss_mb"] > 10 for row in rows), rows  # a Python process: tens of MB at least
    assert [row["delta_mb"] for row in rows[:len(SERVICES)]] == ["-"] * len(SERVICES)
    assert {row["blocks_held"] for row in rows if row["service"].startswith(("prefill", "decode"))} == {0}

    summary = saved["summary"]
    assert list(summary["growth_mb_per_1000_requests"]) == SERVICES
    assert all(isinstance(growth, float) for growth in summary["growth_mb_per_1000_requests"].values()), summary
    assert summary["blocks_leaked"] == 0 and summary["still_running"] == 0, summary
    outcomes = summary["outcomes"]
    assert sum(outcomes.values()) == 60
    assert {name.split(" ")[0] for name in outcomes} == KINDS, outcomes  # every kind drawn by the seeded RNG
    assert summary["unexpected"] == 0, outcomes
    assert [entry["round"] for entry in saved["details"]["rounds"]] == [1, 2, 3]
    assert "--rounds 3" in saved["command"] and saved["machine"]["date"]
    assert "| round | service | requests | rss_mb | delta_mb | blocks_held | pid |" in result.with_suffix(".md").read_text()
