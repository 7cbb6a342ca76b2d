"""Result files never overwrite, the summary text, the progress output, the plots."""

from __future__ import annotations

import io
import json
from datetime import datetime, timezone

import pytest

from cleave.benchmark.plot import plot_run, plot_sweep, plotting_available, tokens_per_second
from cleave.benchmark.progress import Progress
from cleave.benchmark.records import RequestRecord
from cleave.benchmark.report import format_summary, markdown_table, sweep_rows, write_new_json
from cleave.benchmark.stats import SLO, summarize

WHEN = datetime(2026, 12, 3, 18, 0, 5, tzinfo=timezone.utc)


def records() -> list[RequestRecord]:
    done = [RequestRecord(index=i, sent_s=0.1 * i, prompt_len=5, output_len=4, success=True, ttft_s=0.02,
                          e2e_s=0.05, itl_s=[0.01] * 3, output_tokens=4, usage_reported=True) for i in range(4)]
    failed = RequestRecord(index=4, sent_s=0.4, prompt_len=5, output_len=4, status=503, error="busy",
                           error_reason="HTTP 503")
    return [*done, failed]


def test_result_files_get_new_names_and_never_overwrite(tmp_path):
    first = write_new_json(tmp_path, "bench-serve", WHEN, {"run": 1})
    (tmp_path / "bench-serve-20261203T180005Z-1.png").write_bytes(b"a plot whose JSON was removed")
    second = write_new_json(tmp_path, "bench-serve", WHEN, {"run": 2})
    assert first.name == "bench-serve-20261203T180005Z.json"
    assert second.name == "bench-serve-20261203T180005Z-2.json"  # -1 is taken by the plot
    assert json.loads(first.read_text()) == {"run": 1} and json.loads(second.read_text()) == {"run": 2}


def test_summary_text_and_sweep_table():
    summary = summarize(records(), duration_s=0.5, slo=SLO(ttft_ms=10))
    text = format_summary(summary)
    assert "Successful requests:                               4" in text
    assert "Total generated tokens:                           16" in text
    assert "HTTP 503:                                          1" in text
    assert "Requests within SLO:                             0/5" in text
    table = markdown_table(sweep_rows([2.0], [summary]))
    assert table.splitlines()[2] == "| 2 | 4 | 1 | 8.00 | 32.0 | 20.0 / 20.0 | 10.0 / 10.0 | 0.00 | 0.0% |"


def test_progress_is_a_bar_on_a_terminal_and_lines_elsewhere():
    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    terminal, log = Terminal(), io.StringIO()
    for stream in (terminal, log):
        progress = Progress(len(records()), stream=stream)
        for record in records():
            progress.done(record)
        progress.close()
    assert terminal.getvalue().startswith("\r[") and "5/5 requests (1 failed)" in terminal.getvalue()
    lines = log.getvalue().splitlines()
    assert "\r" not in log.getvalue() and lines[-1].startswith("5/5 requests (1 failed)")
    assert len(lines) == 2  # the first finished request and the last, none in between (< 5 s)


def test_tokens_per_second_spreads_usage_over_chunks():
    starts, rates = tokens_per_second(records(), duration_s=1.0)
    bin_s = starts[1] - starts[0]
    assert sum(rate * bin_s for rate in rates) == pytest.approx(16)


@pytest.mark.skipif(not plotting_available(), reason="matplotlib is not installed")
def test_plots_are_written(tmp_path):
    summary = summarize(records(), duration_s=0.5)
    assert plot_run(records(), summary, tmp_path / "run.png", "run").read_bytes()[:4] == b"\x89PNG"
    assert plot_sweep([1.0, 2.0], [summary, summary], tmp_path / "sweep.png", "sweep").read_bytes()[:4] == b"\x89PNG"
