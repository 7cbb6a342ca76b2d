"""bench/prefill_latency.py on CPU with the tiny model: one row per prompt length and prefill
graph setting, the first token after the overlapped loop's two steps, the FLOP floor growing
with the prompt."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_a_cpu_run_reports_each_prompt_length(tmp_path):
    command = [sys.executable, str(ROOT / "bench" / "prefill_latency.py"), "--device", "cpu",
               "--prompt-lens", "8", "40", "--repeats", "2", "--prefill-graph-max-tokens", "0", "48",
               "--top", "5", "--out", str(tmp_path)]
    finished = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert finished.returncode == 0, finished.stderr[-3000:]
    (result,) = tmp_path.glob("prefill-latency-*.json")
    rows = json.loads(result.read_text())["rows"]
    assert [(row["prefill_graphs"], row["prompt_len"]) for row in rows] == [(0, 8), (0, 40), (48, 8), (48, 40)]
    for row in rows:
        assert row["first_token_ms"] > 0 and row["repeats"] == 2
        assert row["steps"] == 2  # overlapped: the step after the prompt's resolves its token
        assert row["device_ms"] is None and row["kernels"] is None and row["top_kernels"] == []  # no CUDA here
    assert 0 < rows[0]["floor_ms"] < rows[1]["floor_ms"]
    bad = subprocess.run([sys.executable, str(ROOT / "bench" / "prefill_latency.py"), "--repeats", "0"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "--repeats" in bad.stderr
