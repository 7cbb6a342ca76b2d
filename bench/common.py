"""Shared timing and reporting helpers for GPU benchmarks.

Timing: `median_ms` wraps triton's do_bench (device events, L2 flushed before each rep,
median); `event_times_ms` times whole calls (a forward, a transfer) with one event pair each; `graph_call_us` captures many calls into one CUDA graph and times its replays, so
launch gaps vanish and the number is device time per call; `host_call_us` is the wall clock
per call of an unsynchronised loop, i.e. what a Python caller pays when launches dominate.
Reporting: `write_results` stores rows as JSON and markdown with the command, machine, date,
library versions and code revision (`code_revision`) that produced them. Scripts name each
run's files with `run_name` (`decode-20261203T184539Z.json`), so a rerun adds a result beside
the committed ones instead of replacing the numbers a document cites.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import shlex
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Sequence

import torch
import triton
from triton.testing import do_bench


@dataclass(frozen=True)
class Machine:
    """Where and with what a benchmark ran."""

    device: str
    torch: str
    triton: str
    cuda: str | None
    host: str
    date: str
    code: str


CODE_REV_ENV = "CLEAVE_CODE_REV"
REPO = Path(__file__).resolve().parent.parent


def code_revision() -> str:
    """The commit the benchmarked code is at: $CLEAVE_CODE_REV when set (a copy of the tree
    without its history, as on a lent GPU machine: pass the commit there), else git's short
    hash of this checkout, `+changes` when tracked files differ from it; "unknown" otherwise."""
    given = os.environ.get(CODE_REV_ENV)
    if given:
        return given
    try:
        def git(*args: str) -> str:
            return subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True, timeout=30,
                                  check=True).stdout.strip()

        commit = git("rev-parse", "--short", "HEAD")
        return commit + ("+changes" if git("status", "--porcelain", "--untracked-files=no") else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def machine_info() -> Machine:
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    return Machine(
        device=device,
        torch=torch.__version__,
        triton=triton.__version__,
        cuda=torch.version.cuda,
        host=platform.node(),
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        code=code_revision(),
    )


def median_ms(fn: Callable[[], object], warmup_ms: int = 10, rep_ms: int = 50) -> float:
    """Median device time of fn() in milliseconds (triton do_bench, L2 flushed per rep)."""
    return float(do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))


def event_times_ms(fn: Callable[[], object], warmup: int = 1, iters: int = 20) -> list[float]:
    """Milliseconds of each of `iters` calls of fn, one CUDA-event pair per call (L2 not flushed)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return times


def graph_call_us(calls: Sequence[Callable[[], object]], warmup_ms: int = 10, rep_ms: int = 50) -> float:
    """Device microseconds per call: all `calls` captured into one CUDA graph, replays timed.

    Pass calls over rotating input sets so that large shapes are read from HBM, not L2.
    """
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for call in calls[:3]:  # compile / autotune / allocate outside the capture
            call()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    graph.replay()
    torch.cuda.synchronize()
    return median_ms(graph.replay, warmup_ms, rep_ms) * 1e3 / len(calls)


def host_call_us(fn: Callable[[], object], iters: int = 200, trials: int = 5) -> float:
    """Median over trials of wall-clock microseconds per call of `iters` back-to-back calls."""
    fn()
    torch.cuda.synchronize()
    per_call = []
    for _ in range(trials):
        start = time.perf_counter()
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
        per_call.append((time.perf_counter() - start) * 1e6 / iters)
    return sorted(per_call)[len(per_call) // 2]


def copy_bandwidth_gbs(num_bytes: int = 1 << 30) -> float:
    """Device-to-device copy bandwidth in GB/s, counting bytes read plus bytes written."""
    src = torch.randn(num_bytes // 2, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src), warmup_ms=25, rep_ms=200)
    return 2 * num_bytes / (ms * 1e-3) / 1e9


def parse_heads(text: str) -> tuple[int, int, int]:
    """An attention layer's heads as Q:KV:D -> (query heads, KV heads, head dim)."""
    import argparse

    q_heads, kv_heads, head_dim = (int(part) for part in text.split(":"))
    if q_heads % kv_heads:
        raise argparse.ArgumentTypeError(f"{q_heads} query heads are not a multiple of {kv_heads} KV heads")
    return q_heads, kv_heads, head_dim


def set_prefill_launch(model, launch: dict) -> None:  # noqa: ANN001
    """Every attention layer's `prefill_launch` (`cleave.kernels.attention_prefill.PrefillLaunch`):
    the layer's default (`prefill_launch_for` its head size) with the JSON keyword arguments
    over it (`{}`: the default itself); scripts take them as `--attention-launches`."""
    from dataclasses import replace

    from cleave.kernels.attention_prefill import prefill_launch_for

    for layer in model.layers:
        layer.self_attn.prefill_launch = replace(prefill_launch_for(layer.self_attn.head_dim), **launch)


def launch_label(launch: dict) -> str:
    """A JSON launch as a row label (sorted keys, no spaces)."""
    return json.dumps(launch, sort_keys=True, separators=(",", ":"))


def _cell(value: object) -> str:
    if value is None:
        return "-"
    return f"{value:.1f}" if isinstance(value, float) else str(value)


def format_table(rows: Sequence[dict], columns: Sequence[str]) -> str:
    """Fixed-width text table of the given columns (floats to 1 decimal)."""
    cells = [[_cell(row.get(col)) for col in columns] for row in rows]
    widths = [max(len(col), *(len(r[i]) for r in cells)) for i, col in enumerate(columns)]
    lines = ["  ".join(col.rjust(w) for col, w in zip(columns, widths))]
    lines += ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in cells]
    return "\n".join(lines)


def _markdown_table(rows: Sequence[dict], columns: Sequence[str]) -> str:
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(_cell(row.get(col)) for col in columns) + " |" for row in rows]
    return "\n".join(lines)


def keep_lowest(best: dict, key: object, row: dict, columns: Sequence[str]) -> None:
    """Fold one round's `row` into `best[key]`: each of `columns` at its lowest over the
    rounds so far (a spike of the machine's own lands in one round), the rest from the row."""
    if key in best:
        row = {**row, **{column: min(row[column], best[key][column]) for column in columns}}
    best[key] = row


def nearest_rank(values: Sequence[float], fraction: float, digits: int = 2) -> float | None:
    """The value `fraction` of the way up the sorted `values` (nearest rank, no interpolation),
    rounded to `digits`; None for no values."""
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, int(fraction * len(ordered)))], digits) if ordered else None


def utc_stamp(now: datetime.datetime | None = None) -> str:
    """UTC time as `20261203T184539Z`: sorts by time and is safe in a file name."""
    now = now or datetime.datetime.now(datetime.timezone.utc)
    return now.astimezone(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ")


def run_name(stem: str, now: datetime.datetime | None = None) -> str:
    """`stem-<UTC time>`, the file stem of one run's results."""
    return f"{stem}-{utc_stamp(now)}"


def run_path(path: str | Path, now: datetime.datetime | None = None) -> Path:
    """`dir/stem.ext` -> `dir/stem-<UTC time>.ext`, for scripts whose flag names a file."""
    path = Path(path)
    return path.with_name(run_name(path.stem, now) + path.suffix)


def write_results(
    out_dir: str | Path,
    name: str,
    rows: Sequence[dict],
    columns: Sequence[str],
    summary: dict | None = None,
    argv: Sequence[str] | None = None,
    details: dict | None = None,
) -> tuple[Path, Path]:
    """Write `name`.json (everything) and `name`.md (header + table) under out_dir; `details`
    (bulky data, e.g. per-step logs) goes into the JSON only.

    Pass `run_name(stem)` as `name`: a run may rewrite its own files (partial results saved
    after each part), and the UTC time keeps every other run's files apart.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    command = shlex.join(["python", *(sys.argv if argv is None else argv)])
    machine = asdict(machine_info())
    payload = {"command": command, "machine": machine, "summary": summary or {}, "rows": list(rows)}
    if details:
        payload["details"] = details
    json_path = out / f"{name}.json"
    json_path.write_text(json.dumps(payload, indent=1))
    header = [
        f"# {name}",
        "",
        f"- command: `{command}`",
        *(f"- {key}: {value}" for key, value in machine.items()),
        *(f"- {key}: {value}" for key, value in (summary or {}).items()),
        "",
    ]
    md_path = out / f"{name}.md"
    md_path.write_text("\n".join(header) + _markdown_table(rows, columns) + "\n")
    return json_path, md_path
