"""bench/transfer_overlap.py: a CPU smoke run of both modes (the numbers mean nothing on CPU)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench" / "transfer_overlap.py"


def test_cpu_smoke_run_writes_a_row_per_mode_and_prompt(tmp_path):
    spec = importlib.util.spec_from_file_location("bench_transfer_overlap", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    argv = ["--device", "cpu", "--shape", "tiny", "--tokens", "40", "--iters", "1", "--warmup", "0",
            "--out", str(tmp_path)]
    assert module.main(argv) == 0
    (result,) = tmp_path.glob("transfer_overlap-*.json")  # one file per run, named by its UTC time
    rows = json.loads(result.read_text())["rows"]
    assert [(row["mode"], row["tokens"]) for row in rows] == [("after", 40), ("layers", 40)]
    assert all(row["landed_ms"] >= row["step_ms"] > 0 for row in rows)
