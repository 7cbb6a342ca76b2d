"""bench/tool_call_stream.py: a short run parses each format's call both ways."""

from __future__ import annotations

from tests.bench.bench_modules import bench_fixture

bench = bench_fixture("tool_call_stream")


def test_short_run_parses_one_call_per_format_and_search(bench, tmp_path):
    rows = bench.main(["--pieces", "300", "--piece-chars", "3", "--rounds", "1", "--out", str(tmp_path)])
    assert {(row["format"], row["search"]) for row in rows} == {
        (name, search) for name in bench.FORMATS for search in ("from where it stopped", "whole call")}
    assert all(row["calls"] == 1 and row["total_ms"] > 0 for row in rows)
    (result,) = tmp_path.glob("tool-call-stream-*.md")
    assert "whole call" in result.read_text()
