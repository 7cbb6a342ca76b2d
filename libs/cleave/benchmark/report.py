"""The results as text and files: the summary block printed after a run, the result JSON
(named by UTC time, never overwriting an earlier one) and the sweep table."""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from cleave.benchmark.stats import Distribution, Summary

_WIDTH = 52


def _row(name: str, value: str) -> str:
    return f"{name:<36}{value:>16}"


def _number(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def format_summary(summary: Summary, title: str = "Serving benchmark") -> str:
    """The run's numbers as an aligned text block (vLLM's layout, so they read alike)."""
    lines = [f" {title} ".center(_WIDTH, "="),
             _row("Successful requests:", f"{summary.completed}"),
             _row("Failed requests:", f"{summary.failed}"),
             _row("Benchmark duration (s):", _number(summary.duration_s)),
             _row("Total input tokens:", f"{summary.total_input_tokens}"),
             _row("Total generated tokens:", f"{summary.total_output_tokens}"),
             _row("Request throughput (req/s):", _number(summary.request_throughput)),
             _row("Input token throughput (tok/s):", _number(summary.input_throughput)),
             _row("Output token throughput (tok/s):", _number(summary.output_throughput))]
    if summary.prompts_with_known_length < summary.completed:
        lines.append(f"  (input tokens of {summary.prompts_with_known_length} of {summary.completed} prompts: "
                     "the server sent no usage; pass --tokenizer)")
    if summary.goodput_requests is not None:
        limits = ", ".join(f"{name} <= {value:g} ms" for name, value in
                           (("TTFT", summary.slo.ttft_ms), ("TPOT", summary.slo.tpot_ms)) if value is not None)
        lines.append(f" Goodput: {limits} ".center(_WIDTH, "-"))
        lines.append(_row("Goodput (req/s):", _number(summary.goodput_rps)))
        lines.append(_row("Requests within SLO:", f"{summary.goodput_requests}/{summary.num_requests}"))
    for title_, distribution in (("Time to First Token", summary.ttft), ("Time per Output Token (excl. 1st token)",
                                 summary.tpot), ("Inter-token Latency", summary.itl), ("End-to-end Latency", summary.e2e)):
        lines += _distribution_rows(title_, distribution)
    if summary.errors:
        lines.append(" Errors ".center(_WIDTH, "-"))
        lines += [_row(f"{reason}:", f"{count}") for reason, count in summary.errors.items()]
    lines.append("=" * _WIDTH)
    return "\n".join(lines)


def _distribution_rows(title: str, distribution: Distribution | None) -> list[str]:
    rows = [f" {title} ".center(_WIDTH, "-")]
    if distribution is None:
        return rows + [_row("(no values)", "-")]
    return rows + [_row("Mean (ms):", _number(distribution.mean_ms)),
                   _row("Median (ms):", _number(distribution.median_ms)),
                   _row("P90 (ms):", _number(distribution.p90_ms)),
                   _row("P99 (ms):", _number(distribution.p99_ms))]


def write_new_json(directory: Path, prefix: str, when: datetime, payload: dict[str, Any]) -> Path:
    """Write `payload` to `<directory>/<prefix>-<UTC time>[-N].json`, a name no file of that
    stem (JSON or plot) holds yet; returns the path (its stem names the run's other files)."""
    directory.mkdir(parents=True, exist_ok=True)
    base = f"{prefix}-{when:%Y%m%dT%H%M%SZ}"
    for attempt in range(10_000):
        stem = base if attempt == 0 else f"{base}-{attempt}"
        if any(directory.glob(f"{stem}.*")):
            continue
        path = directory / f"{stem}.json"
        try:
            with open(path, "x", encoding="utf-8") as file:  # "x": another run writing now cannot clash
                json.dump(payload, file, indent=1, default=str)
                file.write("\n")
        except FileExistsError:
            continue
        return path
    raise FileExistsError(f"no free result name for {base} in {directory}")


SWEEP_COLUMNS = ("rate req/s", "completed", "failed", "req/s", "output tok/s", "TTFT p50 / p99 ms",
                 "TPOT p50 / p99 ms", "goodput req/s", "within SLO")


def sweep_rows(rates: Sequence[float], summaries: Sequence[Summary]) -> list[dict[str, str]]:
    """One table row per offered rate."""
    rows = []
    for rate, summary in zip(rates, summaries):
        fraction = summary.goodput_fraction
        rows.append({
            "rate req/s": f"{rate:g}",
            "completed": str(summary.completed),
            "failed": str(summary.failed),
            "req/s": _number(summary.request_throughput),
            "output tok/s": _number(summary.output_throughput, 1),
            "TTFT p50 / p99 ms": _pair(summary.ttft),
            "TPOT p50 / p99 ms": _pair(summary.tpot),
            "goodput req/s": _number(summary.goodput_rps),
            "within SLO": "-" if fraction is None else f"{fraction:.1%}",
        })
    return rows


def _pair(distribution: Distribution | None) -> str:
    return "-" if distribution is None else f"{distribution.median_ms:.1f} / {distribution.p99_ms:.1f}"


def markdown_table(rows: Sequence[dict[str, str]], columns: Sequence[str] = SWEEP_COLUMNS) -> str:
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(row[column] for column in columns) + " |" for row in rows]
    return "\n".join(lines)
