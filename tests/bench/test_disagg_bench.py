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
    assert row["mode"] == "colocated" and row["round"] == 1 and row["requests"] > 0 and row["errors"] == 0
    assert row["cpu_decode"] > 0 and row["cpu_gateway"] > 0 and row["cpu_clients"] > 0
    assert "cpu_prefill" not in row and row["host_cpus"] == os.cpu_count()  # colocated: no prefill worker
    # the decode engine's steps over the window, from its /metrics (bench/engine_meter.py)
    assert row["decode_step_ms"] > 0 and 0 < row["decode_busy_pct"] <= 100 and row["decode_tokens"] >= 1
    assert "prefill_step_ms" not in row
    assert "cpu_decode" in (out / result.with_suffix(".md").name).read_text()


def test_conditional_policies_parse_with_and_without_the_optional_bounds():
    probe = ("import sys; sys.path.insert(0, sys.argv[1]); import disagg\n"
             "for text in ('1024:0', '256:2048:64', '1024:0::4096'):\n"
             "    policy = disagg.ConditionalPolicy.parse(text)\n"
             "    print(str(policy), ' '.join(policy.gateway_args()))\n"
             "try:\n"
             "    disagg.ConditionalPolicy.parse('1024:0:many')\n"
             "except Exception as error:\n"
             "    print(type(error).__name__, error)\n")
    finished = subprocess.run([sys.executable, "-c", probe, str(ROOT / "bench")], capture_output=True, text=True,
                              timeout=120)
    assert finished.returncode == 0, finished.stderr[-3000:]
    assert finished.stdout.splitlines() == [
        "1024:0 --local-prefill-max-tokens 1024 --remote-prefill-idle-tokens 0",
        "256:2048:64 --local-prefill-max-tokens 256 --remote-prefill-idle-tokens 2048 --local-prefill-max-running 64",
        "1024:0::4096 --local-prefill-max-tokens 1024 --remote-prefill-idle-tokens 0 "
        "--remote-prefill-busy-max-queue-tokens 4096",
        "ArgumentTypeError a conditional policy is LOCAL:IDLE[:RUNNING[:BUSY_QUEUE]] (token and request counts), "
        "not '1024:0:many'",
    ]
