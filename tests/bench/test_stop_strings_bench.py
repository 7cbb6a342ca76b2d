"""bench/stop_strings.py: a short run writes a row per case and search."""

from __future__ import annotations

from tests.bench.bench_modules import bench_fixture

bench = bench_fixture("stop_strings")


def test_short_run_times_both_searches_on_every_case(bench, tmp_path):
    rows = bench.main(["--tokens", "1200", "--rounds", "1", "--out", str(tmp_path)])
    assert {(row["case"], row["search"]) for row in rows} == {
        (case.name, search) for case in bench.cases() for search in ("tail search", "every length")}
    assert all(row["mean_us"] > 0 and row["worst_ms"] > 0 for row in rows)
    (result,) = tmp_path.glob("stop-strings-*.md")
    assert "every length" in result.read_text()
