"""Times `cleave up --demo` end to end, as a first run is: four service processes started
(imports, model load, warm-up), the demo question streamed through the gateway, every
process stopped, once per `--modes` value, over several runs.

The modes run in turn after `--warmup` unrecorded runs each (default one) (the page cache then holds torch and
the checkpoint), wall seconds from a monotonic clock around `cleave up`, CPU seconds from the
kernel's accounting of its reaped children (every service process). Writes
`bench/results/cli/cli_up-<UTC time>.md/.json` with the command, machine and date.

    python bench/cli_up.py --runs 5 --modes disaggregated,colocated
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cli_generate import time_once, timing_row  # noqa: E402
from common import format_table, run_name, write_results  # noqa: E402

COLUMNS = ("mode", "runs", "wall_median_s", "wall_min_s", "wall_max_s", "cpu_median_s")


def command(mode: str, workdir: str) -> list[str]:
    """One `cleave up --demo` run in `mode`, on any free ports, its logs in `workdir`."""
    return [sys.executable, "-m", "cleave.cli.main", "up", "--demo", "--mode", mode, "--grpc-port", "0",
            "--http-port", "0", "--workdir", workdir]


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--modes", default="disaggregated,colocated", help="comma-separated --mode values")
    parser.add_argument("--runs", type=int, default=5, help="timed runs per mode (default 5)")
    parser.add_argument("--warmup", type=int, default=1, help="unrecorded runs per mode first (default 1)")
    parser.add_argument("--timeout-s", type=float, default=300.0, help="bound on one run (default 300)")
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "cli"),
                        help="result directory (default bench/results/cli)")
    args = parser.parse_args(argv)
    modes = args.modes.split(",")
    load_before = os.getloadavg()
    walls: dict[str, list[float]] = {mode: [] for mode in modes}
    cpus: dict[str, list[float]] = {mode: [] for mode in modes}
    with tempfile.TemporaryDirectory(prefix="cleave-up-bench-") as scratch:
        for warm in range(args.warmup):  # not recorded
            for mode in modes:
                time_once(command(mode, f"{scratch}/warm-{mode}-{warm}"), args.timeout_s)
        for run in range(args.runs):
            for mode in modes:
                wall, cpu = time_once(command(mode, f"{scratch}/{mode}-{run}"), args.timeout_s)
                walls[mode].append(wall)
                cpus[mode].append(cpu)
    rows = [{"mode": mode, **timing_row(walls[mode], cpus[mode], command(mode, "DIR"))} for mode in modes]
    summary = {"cores": os.cpu_count(),
               # the machine is shared: a load above the core count inflates wall time, not CPU time
               "load average (1 min) at start / end": f"{load_before[0]:.1f} / {os.getloadavg()[0]:.1f}"}
    json_path, md_path = write_results(args.out, run_name("cli_up"), rows, COLUMNS, summary)
    print(format_table(rows, COLUMNS))
    print(f"wrote {md_path} and {json_path}")
    return rows


if __name__ == "__main__":
    main()
