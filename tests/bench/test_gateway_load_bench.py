"""bench/gateway_load.py end to end on the CPU at tiny sizes: the real gateway streaming from
the fake decode worker to two users over each API delivers every token with no error, and a
profiled run leaves a profile that pstats reads, its top functions in the result's .md."""

from __future__ import annotations

import json
import pstats
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TINY = ["--users", "2", "--output-len", "8", "--duration-s", "2", "--client-procs", "1", "--prompt-len", "16"]
GUARD_S = 300  # a guard against a hang; about 15 s on two cores


def run_bench(tmp_path: Path, *extra: str) -> dict:
    out = tmp_path / "out"
    command = [sys.executable, str(ROOT / "bench" / "gateway_load.py"), *TINY, "--out", str(out), *extra]
    finished = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=GUARD_S)
    assert finished.returncode == 0, finished.stderr[-3000:]
    (result,) = out.glob("gateway-load*.json")
    return {"json": json.loads(result.read_text()), "md": result.with_suffix(".md").read_text()}


@pytest.mark.timeout(GUARD_S)
def test_both_apis_deliver_every_token_with_no_error(tmp_path):
    saved = run_bench(tmp_path, "--api", "grpc,http")["json"]
    rows = saved["rows"]
    assert [row["api"] for row in rows] == ["grpc", "http"]
    for row in rows:
        assert row["errors"] == 0, row["first_error"]
        assert row["requests"] >= 2 and row["tokens"] == 8 * row["requests"], row  # every request to its 8 tokens
        assert row["output_tok_s"] > 0 and row["ttft_p50_ms"] > 0 and row["tpot_p50_ms"] > 0, row
        assert row["gateway_us_per_token"] > 0 and row["profiled"] is False, row
    assert "--api grpc,http" in saved["command"] and saved["machine"]["date"]
    assert saved["summary"]["offered_tok_s"] == 200.0  # 2 users at one token each 10 ms


@pytest.mark.timeout(GUARD_S)
def test_a_profiled_run_writes_the_gateways_profile(tmp_path):
    profile = tmp_path / "profiles" / "gateway.prof"
    result = run_bench(tmp_path, "--api", "grpc", "--profile", str(profile))
    (row,) = result["json"]["rows"]
    assert row["profiled"] is True and row["errors"] == 0 and row["tokens"] > 0, row
    written = tmp_path / "profiles" / "gateway-grpc.prof"
    functions = {name for _, _, name in pstats.Stats(str(written)).stats}  # type: ignore[attr-defined]
    assert "stream_samples" in functions  # the gateway's own streaming loop ran under the profiler
    assert "## Gateway profile, grpc: top 25 by tottime" in result["md"]
    assert "## Gateway profile, grpc: top 25 by cumulative" in result["md"]
