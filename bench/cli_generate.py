"""Times `cleave generate PROMPT` end to end, as a user runs it: process start, imports, model
load, generation and exit, once per `--threads` value, over several runs.

The variants run in turn (1, 2, 0, 1, 2, 0, ...) after one unrecorded warm-up each, so a
machine whose load drifts during the run moves every variant alike. Each run's wall seconds
come from a monotonic clock around the child; its CPU seconds (user + system) from the
kernel's accounting of the reaped child. The medians, with min and max, are written to
`bench/results/cli/cli_generate-<UTC time>.md/.json` with the command, machine and date.

    python bench/cli_generate.py --runs 5 --threads 1,2,0
"""

from __future__ import annotations

import argparse
import os
import resource
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import format_table, run_name, write_results  # noqa: E402

README_PROMPT = "What is 1234 + 567?"
COLUMNS = ("threads", "runs", "wall_median_s", "wall_min_s", "wall_max_s", "cpu_median_s")


def command(args: argparse.Namespace, threads: int) -> list[str]:
    """The `cleave generate` command line of one variant (`--threads 0`: torch's default)."""
    return [sys.executable, "-m", "cleave.cli.main", "generate", args.prompt, "--max-tokens", str(args.max_tokens),
            "--device", "cpu", "--threads", str(threads)]


def time_once(argv: list[str], timeout_s: float) -> tuple[float, float]:
    """(wall seconds, CPU seconds) of one run of `argv`, its output discarded. A failed run
    stops the benchmark: its time would be that of an error, not of a generation."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.monotonic()
    completed = subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, timeout=timeout_s)
    wall = time.monotonic() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if completed.returncode != 0:
        raise SystemExit(f"{shlex.join(argv)} exited with code {completed.returncode}:\n{completed.stderr[-2000:]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu


def timing_row(walls: list[float], cpus: list[float], argv: list[str]) -> dict[str, object]:
    """One variant's runs: their count, wall seconds (median, min, max, each run's), median CPU
    seconds, and the command (`python` for the interpreter's path)."""
    return {
        "runs": len(walls),
        "wall_median_s": statistics.median(walls),
        "wall_min_s": min(walls),
        "wall_max_s": max(walls),
        "cpu_median_s": statistics.median(cpus),
        "wall_s": walls,
        "command": shlex.join(["python", *argv[1:]]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt", default=README_PROMPT, help=f"prompt (default: the README's, {README_PROMPT!r})")
    parser.add_argument("--max-tokens", type=int, default=256, help="cleave generate's --max-tokens (default 256)")
    parser.add_argument("--threads", default="1,2,0", help="comma-separated --threads values to compare (default 1,2,0)")
    parser.add_argument("--runs", type=int, default=5, help="timed runs per variant (default 5)")
    parser.add_argument("--timeout-s", type=float, default=300.0, help="bound on one run (default 300)")
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "cli"),
                        help="result directory (default bench/results/cli)")
    args = parser.parse_args()
    variants = [int(value) for value in args.threads.split(",")]
    load_before = os.getloadavg()
    for threads in variants:  # warm-up: the page cache holds torch and the checkpoint afterwards
        time_once(command(args, threads), args.timeout_s)
    walls: dict[int, list[float]] = {threads: [] for threads in variants}
    cpus: dict[int, list[float]] = {threads: [] for threads in variants}
    for _ in range(args.runs):
        for threads in variants:
            wall, cpu = time_once(command(args, threads), args.timeout_s)
            walls[threads].append(wall)
            cpus[threads].append(cpu)
    rows = [{"threads": threads, **timing_row(walls[threads], cpus[threads], command(args, threads))}
            for threads in variants]
    summary = {"timed command": shlex.join(["python", *command(args, variants[0])[1:-1]]) + " N",
               "threads 0": "torch's default (one per core)",
               "cores": os.cpu_count(),
               # the machine is shared: a load above the core count inflates wall time, not CPU time
               "load average (1 min) at start / end": f"{load_before[0]:.1f} / {os.getloadavg()[0]:.1f}"}
    json_path, md_path = write_results(args.out, run_name("cli_generate"), rows, COLUMNS, summary)
    print(format_table(rows, COLUMNS))
    print(f"wrote {md_path} and {json_path}")


if __name__ == "__main__":
    main()
