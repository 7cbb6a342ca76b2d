"""PNG of an engine sweep (bench/engine_sweep.py): two panels against batch size, one line
per prompt/output mix (and step loop, when a sweep ran both): output tokens/s, and the
steady state's GPU idle %. Skipped and failed points are left out of the lines.

matplotlib is imported only here, with the Agg backend (no display); without it the sweep
still writes its JSON and markdown.

    python bench/engine_sweep_plot.py bench/results/engine/engine-sweep-<UTC time>.json   # PNG beside it
    python bench/engine_sweep_plot.py A.json B.json --out sweep.png     # runs of separate mixes, one figure
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

LINESTYLES = {"overlap": "-", "sync": "--"}


def _series(rows: Sequence[dict]) -> dict[tuple[str, str], list[dict]]:
    """Measured rows grouped by (mode, mix), each sorted by batch."""
    series: dict[tuple[str, str], list[dict]] = {}
    for row in rows:
        if row.get("status") == "ok":
            series.setdefault((row["mode"], row["mix"]), []).append(row)
    return {key: sorted(points, key=lambda row: row["batch"]) for key, points in series.items()}


def plot_sweep(rows: Sequence[dict], path: Path, title: str = "") -> Path | None:
    """Write the two-panel PNG to `path`; None (and a message) when matplotlib is missing."""
    try:
        import matplotlib
    except ImportError:
        print("engine sweep: matplotlib is not installed (pip install 'matplotlib>=3.8'); "
              "no PNG, the JSON and markdown hold every number", file=sys.stderr)
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = _series(rows)
    modes = {mode for mode, _ in series}
    batches = sorted({row["batch"] for points in series.values() for row in points})
    figure, (throughput, idle) = plt.subplots(1, 2, figsize=(12, 4.5), sharex=True)
    has_idle = False
    for (mode, mix), points in series.items():
        label = mix if len(modes) == 1 else f"{mix} ({mode})"
        style = dict(marker="o", linestyle=LINESTYLES.get(mode, "-"), label=label)
        throughput.plot([row["batch"] for row in points], [row["output_tokens_per_s"] for row in points], **style)
        timed = [row for row in points if row.get("gpu_idle_pct") is not None]
        if timed:
            has_idle = True
            idle.plot([row["batch"] for row in timed], [row["gpu_idle_pct"] for row in timed], **style)
    throughput.set(title="output tokens/s", xlabel="batch (sequences)", ylabel="tokens/s")
    idle.set(title="GPU idle (steady state)", xlabel="batch (sequences)", ylabel="% of step time", ylim=(0, 100))
    if not has_idle:
        idle.text(0.5, 0.5, "no device timing (CPU run)", ha="center", va="center", transform=idle.transAxes)
    for axes in (throughput, idle):
        if batches:
            axes.set_xscale("log", base=2)
            axes.set_xticks(batches, [str(batch) for batch in batches], rotation=45)  # 192/256/384 sit close
        axes.grid(True, alpha=0.3)
        if axes.get_legend_handles_labels()[0]:
            axes.legend(title="prompt/output")
    if title:
        figure.suptitle(title)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results", nargs="+", type=Path, help="engine-sweep-*.json files")
    parser.add_argument("--out", type=Path, default=None, help="PNG path (default: the first JSON's, as .png)")
    args = parser.parse_args(argv)
    rows = [row for path in args.results for row in json.loads(path.read_text())["rows"]]
    out = args.out or args.results[0].with_suffix(".png")
    return 0 if plot_sweep(rows, out, title=out.stem) is not None else 1


if __name__ == "__main__":
    sys.exit(main())
