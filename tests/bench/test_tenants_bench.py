"""bench/tenants.py end to end on the CPU: a two-key colocated stack, one key flooding, once
without a cap and once with a cap of 1: the capped run refuses some of the flood, the calm key
gets every answer both times, and the result files hold both rows; and a run with the calm key
at priority -1."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(600)  # a guard against a hang; two stacks start and run in about 30 s
def test_a_short_run_reports_both_caps(tmp_path):
    out = tmp_path / "out"
    command = [sys.executable, str(ROOT / "bench" / "tenants.py"), "--caps", "0,1", "--flood", "3",
               "--flood-tokens", "8", "--calm-requests", "3", "--calm-tokens", "2", "--out", str(out)]
    finished = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert finished.returncode == 0, finished.stderr[-3000:]
    (result,) = out.glob("tenants-*.json")
    uncapped, capped = json.loads(result.read_text())["rows"]
    assert (uncapped["cap"], capped["cap"]) == (0, 1)
    assert uncapped["flood_refused"] == 0 and capped["flood_refused"] > 0  # 3 streams, one allowed
    for row in (uncapped, capped):
        assert row["calm_failed"] == 0 and len(row["calm_ttfts_ms"]) == 3 and row["calm_ttft_p50_ms"] > 0, row
    assert "calm_ttft_p50_ms" in result.with_suffix(".md").read_text()


@pytest.mark.timeout(600)  # a guard against a hang
def test_a_short_run_with_the_calm_tenant_at_a_lower_priority(tmp_path):
    """B at priority -1 over workers of two seats: the gateway takes priorities for that run
    (without `--scheduling-policy priority` every request of B would be refused)."""
    out = tmp_path / "out"
    command = [sys.executable, str(ROOT / "bench" / "tenants.py"), "--caps", "0", "--calm-priorities", "-1",
               "--max-num-seqs", "2", "--flood", "3", "--flood-tokens", "8", "--calm-requests", "2",
               "--calm-tokens", "2", "--out", str(out)]
    finished = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert finished.returncode == 0, finished.stderr[-3000:]
    (result,) = out.glob("tenants-*.json")
    (row,) = json.loads(result.read_text())["rows"]
    assert (row["cap"], row["calm_priority"], row["calm_failed"]) == (0, -1, 0), row
    assert len(row["calm_ttfts_ms"]) == 2


@pytest.mark.timeout(600)  # a guard against a hang
def test_a_short_run_of_many_sample_requests_under_a_samples_cap(tmp_path):
    """Three streams of 4-sample requests on workers of 8 seats, without and with
    `--max-samples-per-key 4`: the capped run refuses some of the flood (one request at a
    time), the calm key gets every answer both times; a samples cap under the flood's n, which
    the gateway would refuse outright, is refused before any stack starts."""
    out = tmp_path / "out"
    command = [sys.executable, str(ROOT / "bench" / "tenants.py"), "--caps", "0", "--samples-caps", "0,4",
               "--flood", "3", "--flood-samples", "4", "--flood-tokens", "8", "--max-num-seqs", "8",
               "--calm-requests", "2", "--calm-tokens", "2", "--out", str(out)]
    finished = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert finished.returncode == 0, finished.stderr[-3000:]
    (result,) = out.glob("tenants-*.json")
    uncapped, capped = json.loads(result.read_text())["rows"]
    assert (uncapped["samples_cap"], capped["samples_cap"]) == (0, 4)
    assert uncapped["flood_refused"] == 0 and capped["flood_refused"] > 0
    for row in (uncapped, capped):
        assert row["calm_failed"] == 0 and len(row["calm_ttfts_ms"]) == 2, row

    refused = subprocess.run([*command[:2], "--samples-caps", "2", "--flood-samples", "4", "--out", str(out)],
                             cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert refused.returncode == 2 and "--samples-caps" in refused.stderr, refused.stderr[-2000:]
