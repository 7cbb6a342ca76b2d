"""bench/disagg.py end to end on the CPU: a colocated stack under a short load, one row with
the latencies, the CPU cores each part of the run used and what the decode engine did."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_a_short_cpu_run_reports_latency_and_cpu_use(tmp_path):
    out = tmp_path / "out"
    command = [sys.executable, str(ROOT / "bench" / "disagg.py"), "--device", "cpu", "--modes", "colocated",
               "--num-users", "2", "--prompt-len", "16", "--output-len", "8", "--duration-s", "1",
               "--long-interval-s", "0", "--client-procs", "1", "--out", str(out)]
    finished = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert finished.returncode == 0, finished.stderr[-3000:]
    (result,) = out.glob("disagg-*.json")
    (row,) = json.loads(result.read_text())["rows"]
    assert row["mode"] == "colocated" and row["requests"] > 0 and row["errors"] == 0
    assert row["cpu_decode"] > 0 and row["cpu_gateway"] > 0 and row["cpu_clients"] > 0
    assert "cpu_prefill" not in row and row["host_cpus"] == os.cpu_count()  # colocated: no prefill worker
    # the decode engine's steps over the window, from its /metrics (bench/engine_meter.py)
    assert row["decode_step_ms"] > 0 and 0 < row["decode_busy_pct"] <= 100 and row["decode_tokens"] >= 1
    assert "prefill_step_ms" not in row
    assert "cpu_decode" in (out / result.with_suffix(".md").name).read_text()
