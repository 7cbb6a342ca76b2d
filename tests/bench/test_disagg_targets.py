"""bench/disagg_targets.py: the served stack's targets checked on recorded H200 runs (the
result files under bench/results/disagg, never rewritten), a run missing its rows, and the
commands it would run."""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "bench" / "results" / "disagg"


@pytest.fixture
def targets():  # type: ignore[no-untyped-def]
    saved_path, saved_common = list(sys.path), sys.modules.get("common")
    spec = importlib.util.spec_from_file_location("bench_disagg_targets", ROOT / "bench" / "disagg_targets.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is made
    try:
        spec.loader.exec_module(module)  # type: ignore[union-attr]
        yield module
    finally:
        sys.modules.pop(spec.name, None)
        sys.path[:] = saved_path
        if saved_common is None:
            sys.modules.pop("common", None)
        else:
            sys.modules["common"] = saved_common


def rows(name: str) -> list[dict]:
    return json.loads((RESULTS / f"{name}.json").read_text())["rows"]


def verdicts(checks) -> list[tuple[str, bool]]:  # type: ignore[no-untyped-def]
    return [(check.target, check.met) for check in checks]


def test_recorded_runs_meet_and_miss_what_they_did(targets):
    default = targets.check_run("default", rows("disagg-20261204T153952Z"), "disagg-20261204T153952Z.md")
    assert all(check.met for check in default) and len(default) == 4
    assert {check.result for check in default} == {"disagg-20261204T153952Z.md"}
    (one_user,) = targets.check_run("one_user", rows("disagg-20261204T174404Z"), "x.md")  # one round
    assert not one_user.met and one_user.measured == pytest.approx(25.36 - 16.46) and one_user.bound == 3.0
    assert verdicts(targets.check_run("http64", rows("disagg-20261204T174017Z"), "x.md")) == [
        ("HTTP TTFT p50 ms <= 80", True), ("HTTP output tok/s >= 15k", False),
        ("HTTP TPOT p50 ms <= 1.15x gRPC's", True)]
    mixed = targets.check_run("mixed", rows("disagg-20261204T173319Z"), "x.md")
    assert [check.met for check in mixed] == [True, True]
    assert mixed[1].measured == pytest.approx(60.41) and mixed[1].bound == pytest.approx(1.5 * 38.23, abs=0.01)


def test_one_user_takes_the_median_gap_over_rounds(targets):
    def pair(round_index: int, colocated: float, disaggregated: float) -> list[dict]:
        return [{"mode": "colocated", "api": "grpc", "round": round_index, "ttft_p50_ms": colocated},
                {"mode": "disaggregated", "api": "grpc", "round": round_index, "ttft_p50_ms": disaggregated}]

    rounds = pair(1, 16.5, 25.4) + pair(2, 20.8, 22.0) + pair(3, 18.0, 20.5)  # gaps 8.9, 1.2, 2.5
    (check,) = targets.check_run("one_user", rounds, "x.md")
    assert check.met and check.measured == pytest.approx(2.5) and "median of 3 rounds" in check.target
    (missing,) = targets.check_run("one_user", rounds[:-1], "x.md")  # round 3 lost its disaggregated row
    assert not missing.met and "no disaggregated row over grpc in round 3" in missing.target


def test_a_run_without_its_rows_fails_and_says_so(targets):
    (check,) = targets.check_run("mixed", rows("disagg-20261204T174017Z"), "")  # an http64 run: no conditional
    assert not check.met and "no conditional row" in check.target and math.isnan(check.measured)
    (empty,) = targets.check_run("one_user", [], "")
    assert not empty.met and "run incomplete" in empty.target


def test_a_dry_run_prints_one_disagg_command_per_workload(tmp_path):
    finished = subprocess.run([sys.executable, str(ROOT / "bench" / "disagg_targets.py"), "--dry-run",
                               "--workloads", "one_user,mixed", "--disagg-arg=--device=cpu", "--out", str(tmp_path)],
                              capture_output=True, text=True, timeout=120)
    assert finished.returncode == 0, finished.stderr
    lines = finished.stdout.splitlines()
    assert len(lines) == 2 and all("disagg.py" in line and f"--out {tmp_path}" in line for line in lines)
    assert "--num-users 1" in lines[0] and "--device=cpu" in lines[0] and "--preset mixed" in lines[1]
    refused = subprocess.run([sys.executable, str(ROOT / "bench" / "disagg_targets.py"), "--dry-run",
                              "--workloads", "two_users", "--out", str(tmp_path)], capture_output=True, text=True,
                             timeout=120)
    assert refused.returncode == 2 and "unknown workload 'two_users'" in refused.stderr
