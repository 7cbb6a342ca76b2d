"""The served stack's targets, checked in one run on one machine.

Runs `bench/disagg.py` once per workload, one after the other, and checks each target
against that run's rows (runs of the same command differ between machines of one kind by
more than some of these margins, so a verdict holds for the machine it ran on):

    one_user  1 user, 512-token prompts, the two modes alternating over 3 rounds: the median
              over rounds of disaggregated TTFT p50 - colocated TTFT p50 <= 3 ms
    default   50 users + an 8k prompt every 3 s, 4 gateways, MPS: disaggregated TTFT p50
              <= 1.1x colocated and <= 60 ms; TPOT p50 <= 2.5 ms; >= 16k output tok/s
    http64    64 users over the OpenAI HTTP API (and the same over gRPC): TTFT p50 <= 80 ms
              and >= 15k output tok/s over HTTP; HTTP TPOT p50 within 15% of gRPC's
    mixed     48 users + 8k-32k prompts, no MPS: conditional mode's SLO goodput >= the
              better fixed mode's and >= 1.5x colocated's

Writes `disagg-targets-<UTC time>.json/.md` under `--out`: one row per check (the measured
values, the bound, met or not, the `disagg-*.md` it came from); the disagg runs' own result
files land beside it.

    python bench/disagg_targets.py --out bench/results/disagg                  # all four, ~10 min on an H200
    python bench/disagg_targets.py --workloads one_user,default --out bench/results/disagg   # or in halves
    python bench/disagg_targets.py --workloads http64,mixed --out bench/results/disagg
    python bench/disagg_targets.py --dry-run --out /tmp/targets                # the commands only
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import format_table, run_name, write_results  # noqa: E402

DISAGG = Path(__file__).resolve().parent / "disagg.py"
WORKLOADS: dict[str, tuple[str, ...]] = {
    "one_user": ("--num-users", "1", "--modes", "colocated,disaggregated", "--long-interval-s", "0",
                 "--duration-s", "8", "--rounds", "3"),
    "default": ("--modes", "disaggregated,colocated", "--gateways", "4", "--mps", "on"),
    "http64": ("--preset", "http64", "--api", "http,grpc", "--modes", "disaggregated", "--gateways", "4",
               "--mps", "on"),
    "mixed": ("--preset", "mixed", "--modes", "disaggregated,conditional,colocated", "--mps", "off",
              "--gateways", "4", "--duration-s", "15"),
}
COLUMNS = ["workload", "target", "measured", "bound", "met", "result"]
Rows = Sequence[Mapping[str, object]]


@dataclass(frozen=True)
class Check:
    """One target of one workload: what was measured against what it must reach."""

    workload: str
    target: str
    measured: float
    bound: float
    met: bool
    result: str = ""  # the disagg result file the rows came from


def row(rows: Rows, mode: str, api: str = "grpc", round_index: int = 1) -> Mapping[str, object]:
    """The run's row of `mode` over `api` in a round (a missing one is a failed run, named)."""
    for candidate in rows:
        if (candidate["mode"] == mode and candidate.get("api", "grpc") == api
                and candidate.get("round", 1) == round_index):
            return candidate
    raise LookupError(f"no {mode} row over {api} in round {round_index} of the run")


def value(rows: Rows, mode: str, column: str, api: str = "grpc") -> float:
    return float(row(rows, mode, api)[column])  # type: ignore[arg-type]


def at_most(workload: str, target: str, measured: float, bound: float) -> Check:
    return Check(workload, target, round(measured, 2), round(bound, 2), measured <= bound)


def at_least(workload: str, target: str, measured: float, bound: float) -> Check:
    return Check(workload, target, round(measured, 2), round(bound, 2), measured >= bound)


def check_one_user(rows: Rows) -> list[Check]:
    rounds = sorted({int(candidate.get("round", 1)) for candidate in rows}) or [1]  # type: ignore[call-overload]
    gaps = [float(row(rows, "disaggregated", round_index=r)["ttft_p50_ms"])  # type: ignore[arg-type]
            - float(row(rows, "colocated", round_index=r)["ttft_p50_ms"]) for r in rounds]  # type: ignore[arg-type]
    return [at_most("one_user", f"disaggregated - colocated TTFT p50 ms <= 3 (median of {len(rounds)} rounds)",
                    statistics.median(gaps), 3.0)]


def check_default(rows: Rows) -> list[Check]:
    ttft = value(rows, "disaggregated", "ttft_p50_ms")
    return [
        at_most("default", "disaggregated TTFT p50 ms <= 1.1x colocated", ttft,
                1.1 * value(rows, "colocated", "ttft_p50_ms")),
        at_most("default", "disaggregated TTFT p50 ms <= 60", ttft, 60.0),
        at_most("default", "disaggregated TPOT p50 ms <= 2.5", value(rows, "disaggregated", "tpot_p50_ms"), 2.5),
        at_least("default", "disaggregated output tok/s >= 16k", value(rows, "disaggregated", "output_tok_s"),
                 16000.0),
    ]


def check_http64(rows: Rows) -> list[Check]:
    http = "http"
    return [
        at_most("http64", "HTTP TTFT p50 ms <= 80", value(rows, "disaggregated", "ttft_p50_ms", http), 80.0),
        at_least("http64", "HTTP output tok/s >= 15k", value(rows, "disaggregated", "output_tok_s", http), 15000.0),
        at_most("http64", "HTTP TPOT p50 ms <= 1.15x gRPC's", value(rows, "disaggregated", "tpot_p50_ms", http),
                1.15 * value(rows, "disaggregated", "tpot_p50_ms")),
    ]


def check_mixed(rows: Rows) -> list[Check]:
    conditional = value(rows, "conditional", "goodput_rps")
    colocated = value(rows, "colocated", "goodput_rps")
    best_fixed = max(value(rows, "disaggregated", "goodput_rps"), colocated)
    return [
        at_least("mixed", "conditional goodput rps >= the better fixed mode's", conditional, best_fixed),
        at_least("mixed", "conditional goodput rps >= 1.5x colocated", conditional, 1.5 * colocated),
    ]


CHECKS: dict[str, Callable[[Rows], list[Check]]] = {
    "one_user": check_one_user, "default": check_default, "http64": check_http64, "mixed": check_mixed,
}


def check_run(workload: str, rows: Rows, result: str) -> list[Check]:
    """The workload's checks on one disagg run's rows; a run without the rows they need
    fails every check of it, saying why."""
    try:
        checks = CHECKS[workload](rows)
    except (LookupError, TypeError, ValueError) as error:
        return [Check(workload, f"run incomplete: {error}", float("nan"), float("nan"), False, result)]
    return [Check(**{**asdict(check), "result": result}) for check in checks]


def command(workload: str, out: Path, extra: Sequence[str]) -> list[str]:
    return [sys.executable, str(DISAGG), *WORKLOADS[workload], *extra, "--out", str(out)]


def run_workload(workload: str, out: Path, extra: Sequence[str]) -> tuple[Rows, str]:
    """Run one workload's disagg command; its rows and result file name (none if it failed)."""
    before = set(out.glob("disagg-*.json"))
    finished = subprocess.run(command(workload, out, extra), check=False)
    written = sorted(set(out.glob("disagg-*.json")) - before)
    if finished.returncode != 0 or not written:
        return [], ""
    return json.loads(written[-1].read_text())["rows"], written[-1].with_suffix(".md").name


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", default=",".join(WORKLOADS),
                        type=lambda text: [_workload(name) for name in text.split(",")],
                        help=f"comma-separated, of {', '.join(WORKLOADS)}")
    parser.add_argument("--disagg-arg", action="append", default=[],
                        help="extra bench/disagg.py flag for every workload, repeatable (e.g. --disagg-arg=--device=cpu)")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    return parser.parse_args(argv)


def _workload(name: str) -> str:
    if name not in WORKLOADS:
        raise argparse.ArgumentTypeError(f"unknown workload {name!r} (of {', '.join(WORKLOADS)})")
    return name


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.dry_run:
        for workload in args.workloads:
            print(" ".join(command(workload, args.out, args.disagg_arg)))
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    name = run_name("disagg-targets")
    checks: list[Check] = []
    for workload in args.workloads:
        rows, result = run_workload(workload, args.out, args.disagg_arg)
        checks.extend(check_run(workload, rows, result))
        table = [asdict(check) for check in checks]
        write_results(args.out, name, table, COLUMNS,
                      summary={"met": sum(c.met for c in checks), "checks": len(checks)})
    print(format_table([asdict(check) for check in checks], COLUMNS))
    return 0 if all(check.met for check in checks) else 1


if __name__ == "__main__":
    raise SystemExit(main())
