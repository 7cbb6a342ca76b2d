"""bench/penalty_counts.py: a short run checks both counts agree and writes a row per case."""

from __future__ import annotations

from tests.bench.bench_modules import bench_fixture

bench = bench_fixture("penalty_counts")


def test_short_run_counts_both_ways(bench, tmp_path):
    rows = bench.main(["--cases", "2x50,3x10", "--vocab", "64", "--steps", "3", "--out", str(tmp_path)])
    assert [(row["batch"], row["outputs"]) for row in rows] == [(2, 50), (3, 10)]
    assert all(row["kept_ms"] > 0 and row["recounted_ms"] > 0 for row in rows)
    (result,) = tmp_path.glob("penalty-counts-*.md")
    assert "recounted_ms" in result.read_text()
