"""PNG plots of a run (latency CDFs, output tokens/s over time) and of a sweep (goodput and
throughput against the offered rate).

matplotlib is optional (the `dev` extra): `plotting_available()` says whether it is there,
and it is imported only when a plot is drawn, so `cleave --help` never loads it. Figures are
drawn with the object API on the Agg canvas: no pyplot state, no display needed.
"""

from __future__ import annotations

import importlib.util
import math
from collections.abc import Sequence
from pathlib import Path

from cleave.benchmark.records import RequestRecord
from cleave.benchmark.stats import Summary

_MIN_BIN_S = 0.05
_NUM_BINS = 50


def plotting_available() -> bool:
    return importlib.util.find_spec("matplotlib") is not None


def _figure(rows: int, cols: int, title: str):  # type: ignore[no-untyped-def]
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(6 * cols, 4 * rows), layout="constrained")
    FigureCanvasAgg(figure)
    figure.suptitle(title)
    return figure, figure.subplots(rows, cols, squeeze=False)


def _cdf(axes, values_ms: Sequence[float], label: str) -> None:  # type: ignore[no-untyped-def]
    if not values_ms:
        return
    ordered = sorted(values_ms)
    fractions = [(index + 1) / len(ordered) for index in range(len(ordered))]
    axes.step(ordered, fractions, where="post", label=f"{label} (n={len(ordered)})")


def tokens_per_second(records: Sequence[RequestRecord], duration_s: float) -> tuple[list[float], list[float]]:
    """(bin start times, output tokens/s in each bin): each chunk with a choice counts its
    share of its request's output tokens (usage can count more tokens than chunks)."""
    bin_s = max(_MIN_BIN_S, duration_s / _NUM_BINS)
    num_bins = max(1, math.ceil(duration_s / bin_s))
    counts = [0.0] * num_bins
    for record in records:
        times = record.token_times_s() if record.success else []
        if not times:
            continue
        per_chunk = record.output_tokens / len(times)
        for time_s in times:
            counts[min(int(time_s / bin_s), num_bins - 1)] += per_chunk
    starts = [index * bin_s for index in range(num_bins)]
    widths = [min(bin_s, duration_s - start) if index == num_bins - 1 else bin_s
              for index, start in enumerate(starts)]  # the last bin ends with the run
    return starts, [count / width if width > 0 else 0.0 for count, width in zip(counts, widths)]


def plot_run(records: Sequence[RequestRecord], summary: Summary, path: Path, title: str) -> Path:
    done = [r for r in records if r.success]
    figure, axes = _figure(2, 2, title)
    panels = (
        (axes[0][0], "time to first token", [("TTFT", [r.ttft_s * 1000 for r in done if r.ttft_s is not None])]),
        (axes[0][1], "per-token latency", [("TPOT", [r.tpot_s * 1000 for r in done if r.tpot_s is not None]),
                                          ("ITL", [gap * 1000 for r in done for gap in r.itl_s])]),
        (axes[1][0], "end-to-end latency", [("e2e", [r.e2e_s * 1000 for r in done if r.e2e_s is not None])]),
    )
    for panel, name, series in panels:
        for label, values in series:
            _cdf(panel, values, label)
        panel.set(title=f"{name} CDF", xlabel="ms", ylabel="fraction", ylim=(0, 1.02))
        panel.grid(alpha=0.3)
        if any(values for _, values in series):
            panel.legend(loc="lower right")
    starts, rates = tokens_per_second(records, summary.duration_s)
    throughput = axes[1][1]
    throughput.plot([*starts, summary.duration_s], [*rates, rates[-1]], drawstyle="steps-post")
    throughput.axhline(summary.output_throughput, linestyle="--", color="gray",
                       label=f"mean {summary.output_throughput:,.0f} tok/s")
    throughput.set(title="output tokens/s over time", xlabel="s since start", ylabel="tokens/s")
    throughput.set_ylim(bottom=0)
    throughput.grid(alpha=0.3)
    throughput.legend(loc="lower right")
    figure.savefig(path, dpi=100)
    return path


def plot_sweep(rates: Sequence[float], summaries: Sequence[Summary], path: Path, title: str) -> Path:
    figure, axes = _figure(1, 2, title)
    load, latency = axes[0]
    load.plot(rates, [s.request_throughput for s in summaries], marker="o", label="completed req/s")
    if any(s.goodput_rps is not None for s in summaries):
        load.plot(rates, [s.goodput_rps or 0.0 for s in summaries], marker="s", label="goodput req/s")
    load.plot(rates, rates, linestyle=":", color="gray", label="offered")
    load.set(title="goodput vs load", xlabel="offered request rate (req/s)", ylabel="req/s")
    load.grid(alpha=0.3)
    load.legend()
    for name, pick in (("TTFT p99", lambda s: s.ttft), ("TPOT p99", lambda s: s.tpot)):
        values = [pick(s).p99_ms if pick(s) is not None else float("nan") for s in summaries]
        latency.plot(rates, values, marker="o", label=name)
    latency.set(title="tail latency vs load", xlabel="offered request rate (req/s)", ylabel="ms", yscale="log")
    latency.grid(alpha=0.3)
    latency.legend()
    figure.savefig(path, dpi=100)
    return path
