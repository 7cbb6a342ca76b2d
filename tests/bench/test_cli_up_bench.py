"""bench/cli_up.py: one timed `cleave up --demo` writes its row, with the command, to JSON and
markdown."""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.mark.timeout(300)
def test_one_timed_demo_writes_json_and_markdown(monkeypatch, tmp_path):
    monkeypatch.syspath_prepend(str(BENCH))
    cli_up = importlib.import_module("cli_up")
    (row,) = cli_up.main(["--modes", "colocated", "--runs", "1", "--warmup", "0", "--out", str(tmp_path)])
    assert row["mode"] == "colocated" and row["runs"] == 1 and 0 < row["wall_median_s"] == row["wall_s"][0]
    assert row["cpu_median_s"] > 0 and "up --demo --mode colocated" in row["command"]
    (json_path,) = tmp_path.glob("cli_up-*.json")
    saved = json.loads(json_path.read_text())
    assert saved["rows"][0]["wall_s"] == row["wall_s"] and saved["machine"]["date"]
    assert "| colocated | 1 |" in json_path.with_suffix(".md").read_text()
