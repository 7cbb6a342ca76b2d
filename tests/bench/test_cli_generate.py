"""bench/cli_generate.py times real `cleave generate` runs and writes a stamped result pair."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from cleave.engine.llm import default_model_path

BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.mark.timeout(240)
def test_one_run_per_variant_writes_json_and_markdown(tmp_path):
    if default_model_path() is None:
        pytest.skip("the shipped reasoner (cleave/assets/reasoner) is not in this checkout")
    completed = subprocess.run(
        [sys.executable, str(BENCH / "cli_generate.py"), "--runs", "1", "--threads", "1", "--max-tokens", "2",
         "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=230,
    )
    assert completed.returncode == 0, completed.stdout + completed.stderr
    (json_path,) = tmp_path.glob("cli_generate-*.json")
    assert re.fullmatch(r"cli_generate-\d{8}T\d{6}Z\.json", json_path.name)
    assert json_path.with_suffix(".md").is_file()
    result = json.loads(json_path.read_text())
    (row,) = result["rows"]
    assert row["threads"] == 1 and row["runs"] == 1
    assert 0 < row["wall_min_s"] <= row["wall_median_s"] <= row["wall_max_s"]
    assert row["cpu_median_s"] > 0  # the child's CPU time was counted, not this process's
    assert "generate 'What is 1234 + 567?'" in row["command"] and row["command"].endswith("--threads 1")
    assert result["machine"]["date"] and "cli_generate.py" in result["command"]


def test_a_failing_command_stops_the_run_and_writes_nothing(tmp_path):
    completed = subprocess.run(
        [sys.executable, str(BENCH / "cli_generate.py"), "--runs", "1", "--threads", "1", "--prompt", "x",
         "--max-tokens", "-1", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=120,
    )
    assert completed.returncode == 1
    assert "exited with code" in completed.stderr and "--max-tokens -1" in completed.stderr
    assert not list(tmp_path.iterdir())
