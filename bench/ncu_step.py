"""Hardware counters of every kernel in one graph-replayed decode step (Nsight Compute).

`bench/decode_profile.py` says how long each kernel of a step takes; this says why. It runs
itself under `ncu` (`--run`: build the model and the step as decode_profile does, replay it
a few times unprofiled, then once between cudaProfilerStart and cudaProfilerStop), with each
kernel node of the graph profiled on its own (`--graph-profiling node`) and the clocks left
alone (`--clock-control none`). Per kernel, in step order, it reports the duration, DRAM
and SM throughput as a share of the device's peak, achieved occupancy, registers per
thread, grid and block size and the cycles an issued instruction waits on memory (long
scoreboard), summed by kernel name in the table (each call in step order in the JSON).

    python bench/ncu_step.py --cases 64x1024 --out bench/results/decode
    python bench/ncu_step.py --model qwen3-30b-a3b --cases 1x1024 --kernels "_gate_up|_down_sum"

`ncu` reads the counters on the device kinds whose runtime lets it (on the lent H100s, not on
the lent H200s: ../.library/device/KINDS.md). Each kernel replays many times under the
profiler, so a step takes seconds to minutes; the durations are those of a kernel run alone,
without the overlap programmatic dependent launch gives it inside the step. A MoE model's
step (~340 kernels for Qwen3-30B-A3B's shape) took longer than 6 minutes on an H100:
`--kernels` profiles only the kernels whose names match a regular expression.
"""

from __future__ import annotations

import argparse
import csv
import io
import os
import shutil
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import format_table, run_name, write_results  # noqa: E402

# column -> the ncu metrics that hold it, newest name first (versions rename some); all come from
# SECTIONS, whose every metric the raw page lists
METRICS = {
    "us": ("gpu__time_duration.sum",),
    "dram_pct": ("gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed",
                 "dram__throughput.avg.pct_of_peak_sustained_elapsed"),
    "sm_pct": ("sm__throughput.avg.pct_of_peak_sustained_elapsed",),
    "occupancy_pct": ("sm__warps_active.avg.pct_of_peak_sustained_active",),
    "registers": ("launch__registers_per_thread",),
    "grid": ("launch__grid_size",),
    "block": ("launch__block_size",),
    "long_scoreboard": ("smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio",
                        "smsp__average_warp_latency_issue_stalled_long_scoreboard.ratio"),
}
# ncu's time units (older versions spell them out) in microseconds
TIME_UNITS = {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3, "s": 1e6, "second": 1e6}
SECTIONS = ("SpeedOfLight", "Occupancy", "LaunchStats", "WarpStateStats")
CALL_COLUMNS = ["case", "index", "kernel", *METRICS]
WEIGHTED = ("dram_pct", "sm_pct", "occupancy_pct", "long_scoreboard")  # averaged over calls by duration
SUMMARY_COLUMNS = ["case", "kernel", "calls", "us", *WEIGHTED]
NAME_WIDTH = 60


def parse_raw_csv(text: str) -> list[dict[str, object]]:
    """Rows of `ncu --csv --page raw` output (a header row, a units row, then one row per
    profiled kernel; lines before the header are ncu's own messages), each with the kernel
    name and METRICS' columns: durations in microseconds, values ncu did not collect or could
    not read (`n/a`) as None."""
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith('"ID"')), None)
    if start is None:
        raise ValueError("no ncu CSV header in the output (was anything profiled?)")
    reader = csv.reader(io.StringIO("\n".join(lines[start:])))
    header = next(reader)
    units = dict(zip(header, next(reader)))
    rows = []
    for record in reader:
        if len(record) != len(header):
            continue
        fields = dict(zip(header, record))
        row: dict[str, object] = {"index": int(fields["ID"]), "kernel": fields["Kernel Name"]}
        for column, names in METRICS.items():
            metric = next((name for name in names if name in fields), None)
            row[column] = None if metric is None else _number(fields[metric], units.get(metric, ""), column == "us")
        rows.append(row)
    return rows


def _number(value: str | None, unit: str, is_time: bool = False) -> float | None:
    """ncu's value as a float (thousands separators dropped; a time in microseconds, from the
    unit ncu printed it in)."""
    if value is None or value.strip() in ("", "n/a"):
        return None
    number = float(value.replace(",", ""))
    if not is_time:
        return number
    if unit.strip() not in TIME_UNITS:
        raise ValueError(f"ncu gave a duration in {unit!r}, not a time unit this script knows ({', '.join(TIME_UNITS)})")
    return number * TIME_UNITS[unit.strip()]


def by_kernel(case: str, rows: Sequence[dict[str, object]]) -> list[dict[str, object]]:
    """Per kernel name: calls, total microseconds and the WEIGHTED columns averaged over its calls
    by duration, slowest first."""
    groups: dict[str, list[dict[str, object]]] = {}
    for row in rows:
        groups.setdefault(str(row["kernel"]), []).append(row)
    summary = []
    for name, members in groups.items():
        total = sum(float(row["us"] or 0.0) for row in members)
        summary.append({"case": case, "kernel": name[:NAME_WIDTH], "calls": len(members), "us": round(total, 1),
                        **{column: _weighted(members, column) for column in WEIGHTED}})
    return sorted(summary, key=lambda row: -float(row["us"]))


def _weighted(rows: Sequence[dict[str, object]], column: str) -> float | None:
    """`column` averaged by duration over the `rows` ncu gave it for (None where it gave none)."""
    pairs = [(float(row["us"] or 0.0), float(row[column])) for row in rows if row[column] is not None]
    weight = sum(us for us, _ in pairs)
    if weight <= 0:
        return None
    return round(sum(us * value for us, value in pairs) / weight, 1)


def run_profiled_step(args: argparse.Namespace) -> None:
    """`--run`: one case's step replayed unprofiled, then once inside the profiler's range."""
    import torch
    from decode import Case
    from decode_profile import case_steps

    device = torch.device("cuda")
    case = Case(*map(int, args.cases.split("x")))
    with torch.inference_mode():
        replay, _ = case_steps(args.model, [case], args.block_size, args.max_model_len, device)(case)
        for _ in range(3):
            replay()
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStart()
        replay()
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStop()


def ncu_command(ncu: str, args: argparse.Namespace, case: str) -> list[str]:
    """The ncu command line that profiles `case`'s step (this script with `--run`)."""
    only = ["--kernel-name", f"regex:{args.kernels}"] if args.kernels else []
    return [ncu, "--clock-control", "none", "--profile-from-start", "off", "--graph-profiling", "node", *only,
            *(arg for section in SECTIONS for arg in ("--section", section)), "--csv", "--page", "raw",
            sys.executable, str(Path(__file__).resolve()), "--run", "--model", args.model, "--cases", case,
            "--block-size", str(args.block_size), "--max-model-len", str(args.max_model_len)]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", default="64x1024", help="BATCHxCONTEXT, comma-separated (--run: one)")
    parser.add_argument("--model", choices=("llama-1b", "qwen3-30b-a3b", "gpt-oss-20b"), default="llama-1b")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--kernels", default=None,
                        help="profile only the kernels whose names match this regular expression")
    parser.add_argument("--ncu", default=os.environ.get("NCU", "ncu"), help="the Nsight Compute CLI")
    parser.add_argument("--timeout", type=float, default=540.0, help="seconds for each case's ncu run")
    parser.add_argument("--run", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help="directory for ncu_step-<UTC time>.json / .md")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.run:
        run_profiled_step(args)
        return 0
    ncu = shutil.which(args.ncu)
    if ncu is None:
        raise SystemExit(f"{args.ncu!r} not found: pass --ncu PATH (Nsight Compute's CLI) or set NCU")
    calls, rows = [], []
    for case in args.cases.split(","):
        try:
            done = subprocess.run(ncu_command(ncu, args, case), capture_output=True, text=True, timeout=args.timeout)
        except subprocess.TimeoutExpired:
            raise SystemExit(f"ncu did not finish {case} in {args.timeout:.0f} s: profile fewer kernels "
                             "(--kernels REGEX) or give it longer (--timeout)") from None
        if done.returncode != 0:
            raise SystemExit(f"ncu failed on {case} (exit {done.returncode}):\n{done.stderr[-3000:]}")
        kernels = parse_raw_csv(done.stdout)
        label = f"b{case.replace('x', '/ctx')}"
        calls.extend({"case": label, **row} for row in kernels)
        rows.extend(by_kernel(label, kernels))
        print(format_table([row for row in rows if row["case"] == label], SUMMARY_COLUMNS), flush=True)
    if args.out:
        write_results(args.out, run_name("ncu_step"), rows, SUMMARY_COLUMNS,
                      {"model": args.model, "max_model_len": args.max_model_len, "sections": ", ".join(SECTIONS)},
                      details={"kernels": calls, "kernel_columns": CALL_COLUMNS})
    return 0


if __name__ == "__main__":
    sys.exit(main())
