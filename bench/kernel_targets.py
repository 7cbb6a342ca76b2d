"""The engine's and the MoE models' open GPU targets, checked in one run on one machine.

Runs the benches below one after the other, each as a subprocess writing its own result
files into `--out`, reads each run's JSON and checks every target against it. The bounds are
the two issues' and were set on one H200 (decode.py's and moe.py's rooflines and peak are
the H200's too), so a verdict from another card says little.

    engine       bench/engine.py, 256 x (512 prompt + 1024 output), overlapped loop: >= 50k output tok/s,
                 GPU idle < 5% at batch 193-256 (the "decode 193-4096" row), no Triton compile after start-up
    decode       bench/decode.py, graph-replayed steps issued back to back (`pipelined_ms`, the device time
                 per step): batch 1 / 1k <= 700 us, 64 / 1k <= 1450 us; 32 / 32k >= 85% of the HBM roofline
    prefill      bench/prefill.py, 8192 tokens: <= 40 ms and >= 1.25x transformers (SDPA) in the same run
    moe_decode   bench/moe.py --part decode, Qwen3-30B-A3B shape: batch 1 / 1k <= 2200 us; batch 64 / 1k
                 >= 70% of the roofline of the experts it touches
    gpt_oss      the same, gpt-oss-20b shape: batch 1 / 1k within 1.5x of its roofline (us <= 1.5 roofline_us)
    moe_layer    bench/moe.py --part layer: the fused layer faster than transformers and than the reference
                 under torch.compile at 1, 16, 64, 512 and 8192 tokens
    moe_prefill  bench/moe.py --part prefill, 8192 tokens: >= 50% of the H200's dense bf16 peak on active FLOPs

Writes `kernel-targets-<UTC time>.json/.md` under `--out` (rewritten after each bench): one
row per check (the issue, the target, measured, bound, met or not, the result JSON it came
from). A bench that fails, runs past `--timeout-s` or lacks a row a target needs fails that
target, saying what is missing, and the next bench still runs; the exit status is 0 whenever
the runner ran, met or not.

    python bench/kernel_targets.py --out bench/results/kernel_targets                       # all: ~2.5 min on an H100
    python bench/kernel_targets.py --targets engine,decode,prefill --out bench/results/kernel_targets
    python bench/kernel_targets.py --dry-run --out /tmp/targets                             # the commands only
"""

from __future__ import annotations

import argparse
import json
import operator
import re
import shlex
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import format_table, run_name, write_results  # noqa: E402

BENCH = Path(__file__).resolve().parent
ENGINE_ISSUE = "the engine keeps the GPU busy"
MOE_ISSUE = "MoE reasoning models"
COLUMNS = ["issue", "target", "measured", "bound", "met", "result"]
Result = Mapping[str, Any]  # one bench run's parsed JSON
# Columns a bench added later, with the value every older row had then.
OLDER_ROWS = {"route": "launch", "attention": "default", "launch": "default"}


@dataclass(frozen=True)
class Target:
    """One performance target: its wording, and how to read (measured, bound) off a bench's
    result JSON (raising LookupError, naming it, when the run lacks a value)."""

    issue: str
    text: str
    holds: Callable[[float, float], bool]  # operator.le / lt / ge on (measured, bound)
    measure: Callable[[Result], tuple[float, float]]


@dataclass(frozen=True)
class Check:
    """One target checked on one bench run."""

    issue: str
    target: str
    measured: float | None  # None: not measured (the target says why)
    bound: float | None
    met: bool
    result: str = ""  # the bench's result JSON the values came from


@dataclass(frozen=True)
class Bench:
    """One bench run: bench/`script` with `args` (and `--out`), the stem of the JSON it writes
    (`stem-<UTC time>.json`) and the targets read off that JSON."""

    script: str
    args: tuple[str, ...]
    stem: str
    targets: tuple[Target, ...]
    out_file: str = ""  # bench/prefill.py's --out names a file (it writes STEM-<UTC time>.json beside it)


def row(rows: Sequence[Mapping[str, Any]], **match: object) -> Mapping[str, Any]:
    """The row whose columns equal `match` (a column older runs lack counts as `OLDER_ROWS`')."""
    for candidate in rows:
        if all(candidate.get(column, OLDER_ROWS.get(column)) == value for column, value in match.items()):
            return candidate
    raise LookupError("no row with " + ", ".join(f"{column}={value}" for column, value in match.items()))


def cell(found: Mapping[str, Any], column: str) -> float:
    """A row's number (a row the bench recorded as an error names it)."""
    if found.get(column) is None:
        why = f": {found['error']}" if "error" in found else ""
        raise LookupError(f"the row {_label(found)} has no {column}{why}")
    return float(found[column])


def summary_value(result: Result, key: str) -> float:
    if result.get("summary", {}).get(key) is None:
        raise LookupError(f"no {key} in the run's summary")
    return float(result["summary"][key])


def _label(found: Mapping[str, Any]) -> str:
    keys = ("mode", "batch", "context", "tokens", "method", "name")
    return ", ".join(f"{key}={found[key]}" for key in keys if key in found)


def fixed(bound: float, read: Callable[[Result], float]) -> Callable[[Result], tuple[float, float]]:
    return lambda result: (read(result), bound)


# -- engine: bench/engine.py's summary keys and rows carry the run's label ("overlap" for one
# run of the overlapped loop in its default configuration)

def engine_run(result: Result) -> Result:
    """The result, once its summary shows the issue's workload (256 x (512 + 1024))."""
    for key, expected in (("requests", 256), ("prompt_len", 512), ("output_len", 1024)):
        if summary_value(result, key) != expected:
            raise LookupError(f"the run's {key} is {result['summary'][key]}, not {expected}")
    return result


def engine_targets(run: str = "overlap") -> tuple[Target, ...]:
    """The engine issue's targets on bench/engine.py's run labelled `run`."""
    return (
        Target(ENGINE_ISSUE, "256 x (512 + 1024): output tok/s >= 50k", operator.ge, fixed(50000.0, lambda result: (
            summary_value(engine_run(result), f"output_tokens_per_s_{run}")))),
        Target(ENGINE_ISSUE, "GPU idle % at batch 193-256 < 5", operator.lt, fixed(5.0, lambda result: cell(
            row(engine_run(result)["rows"], mode=run, batch="decode 193-4096"), "gpu_idle_pct"))),
        Target(ENGINE_ISSUE, "Triton compiles after start-up = 0", operator.le, fixed(0.0, lambda result: (
            summary_value(engine_run(result), f"compiles_in_run_{run}")))),
    )


# -- decode: bench/decode.py's graph rows; `pipelined_ms` is the device time per step

def graph_step_us(batch: int, context: int) -> Callable[[Result], float]:
    return lambda result: 1e3 * cell(row(result["rows"], mode="graph", batch=batch, context=context), "pipelined_ms")


def graph_roofline_pct(batch: int, context: int) -> Callable[[Result], float]:
    return lambda result: cell(row(result["rows"], mode="graph", batch=batch, context=context),
                               "pipelined_roofline_pct")


# -- prefill: bench/prefill.py's "results", one per implementation

def prefill_ms(name: str, tokens: int = 8192) -> Callable[[Result], float]:
    def read(result: Result) -> float:
        if result.get("num_tokens") != tokens:
            raise LookupError(f"the run prefilled {result.get('num_tokens')} tokens, not {tokens}")
        return cell(row(result["results"], name=name), "median_ms")
    return read


def faster_than_sdpa(result: Result) -> tuple[float, float]:
    return prefill_ms("cleave")(result), prefill_ms("transformers-sdpa")(result) / 1.25


# -- MoE: bench/moe.py's rows; the summary's shape names the architecture (runs before it
# did were all Qwen3-30B-A3B's)

def moe_rows(result: Result, architecture: str) -> Sequence[Mapping[str, Any]]:
    found = result.get("summary", {}).get("shape", {}).get("architecture", "qwen3-moe")
    if found != architecture:
        raise LookupError(f"the run is of the {found} shape, not {architecture}")
    return result["rows"]


def moe_decode(batch: int, column: str, architecture: str = "qwen3-moe") -> Callable[[Result], float]:
    return lambda result: cell(row(moe_rows(result, architecture), batch=batch, context=1024, route="launch",
                                   attention="default"), column)


def gpt_oss_within_roofline(result: Result) -> tuple[float, float]:
    return moe_decode(1, "us", "gpt-oss")(result), 1.5 * moe_decode(1, "roofline_us", "gpt-oss")(result)


def fused_layer_vs_baselines(tokens: int) -> Callable[[Result], tuple[float, float]]:
    def measure(result: Result) -> tuple[float, float]:
        rows = moe_rows(result, "qwen3-moe")
        baselines = [cell(row(rows, tokens=tokens, method=method), "us") for method in ("transformers",
                                                                                         "reference+compile")]
        return cell(row(rows, tokens=tokens, method="fused"), "us"), min(baselines)
    return measure


def moe_prefill_peak_pct(result: Result) -> float:
    return cell(row(moe_rows(result, "qwen3-moe"), tokens=8192, launch="default"), "peak_pct")


LAYER_TOKENS = (1, 16, 64, 512, 8192)
DECODE_1K = (
    Target(ENGINE_ISSUE, "graph step us, batch 1 / 1k <= 700", operator.le, fixed(700.0, graph_step_us(1, 1024))),
    Target(ENGINE_ISSUE, "graph step us, batch 64 / 1k <= 1450", operator.le, fixed(1450.0, graph_step_us(64, 1024))),
)
DECODE_32K = (
    Target(ENGINE_ISSUE, "graph step % of HBM roofline, batch 32 / 32k >= 85", operator.ge,
           fixed(85.0, graph_roofline_pct(32, 32768))),
)
PREFILL = (
    Target(ENGINE_ISSUE, "8192-token prefill ms <= 40", operator.le, fixed(40.0, prefill_ms("cleave"))),
    Target(ENGINE_ISSUE, "8192-token prefill ms <= transformers-sdpa's / 1.25", operator.le, faster_than_sdpa),
)
MOE_DECODE = (
    Target(MOE_ISSUE, "Qwen3-30B-A3B step us, batch 1 / 1k <= 2200", operator.le, fixed(2200.0, moe_decode(1, "us"))),
    Target(MOE_ISSUE, "Qwen3-30B-A3B step % of touched-expert roofline, batch 64 / 1k >= 70", operator.ge,
           fixed(70.0, moe_decode(64, "roofline_pct"))),
)
GPT_OSS = (
    Target(MOE_ISSUE, "gpt-oss-20b step us, batch 1 / 1k <= 1.5x its roofline_us", operator.le,
           gpt_oss_within_roofline),
)
MOE_LAYER = tuple(
    Target(MOE_ISSUE, f"fused layer us, {tokens} token{'s' * (tokens > 1)} < transformers' and reference+compile's",
           operator.lt, fused_layer_vs_baselines(tokens))
    for tokens in LAYER_TOKENS
)
MOE_PREFILL = (
    Target(MOE_ISSUE, "Qwen3-30B-A3B 8192-token prefill % of dense bf16 peak >= 50", operator.ge,
           fixed(50.0, moe_prefill_peak_pct)),
)
# Each bench measures its targets' cases and no more.
GROUPS: dict[str, tuple[Bench, ...]] = {
    "engine": (Bench("engine.py", ("--modes", "overlap", "--breakdown-batch", "0"), "engine", engine_targets()),),
    "decode": (Bench("decode.py", ("--batches", "1,64", "--contexts", "1024"), "decode", DECODE_1K),
               Bench("decode.py", ("--batches", "32", "--contexts", "32768"), "decode", DECODE_32K)),
    "prefill": (Bench("prefill.py", ("--tokens", "8192"), "prefill", PREFILL, out_file="prefill.json"),),
    "moe_decode": (Bench("moe.py", ("--part", "decode", "--batch", "1,64", "--context", "1024"), "moe-decode",
                         MOE_DECODE),),
    "gpt_oss": (Bench("moe.py", ("--part", "decode", "--model", "gpt-oss-20b", "--batch", "1", "--context", "1024"),
                      "moe-decode", GPT_OSS),),
    "moe_layer": (Bench("moe.py", ("--part", "layer", "--tokens", ",".join(map(str, LAYER_TOKENS))), "moe-layer",
                        MOE_LAYER),),
    "moe_prefill": (Bench("moe.py", ("--part", "prefill", "--prefill-tokens", "8192"), "moe-prefill", MOE_PREFILL),),
}

def check(targets: Sequence[Target], result: Result, result_name: str) -> list[Check]:
    """Each target on one bench run's JSON; one the run lacks a value for fails, saying which."""
    checks = []
    for target in targets:
        try:
            measured, bound = target.measure(result)
        except (LookupError, TypeError, ValueError) as error:
            checks.append(Check(target.issue, f"{target.text}: not measured, {_reason(error)}", None, None, False,
                                result_name))
            continue
        checks.append(Check(target.issue, target.text, round(measured, 3), round(bound, 3),
                            bool(target.holds(measured, bound)), result_name))
    return checks


def _reason(error: Exception) -> str:
    return str(error) if isinstance(error, LookupError) and not isinstance(error, KeyError) else repr(error)


def not_measured(targets: Sequence[Target], why: str) -> list[Check]:
    """Every target of a bench that left no result to read, failed with the reason."""
    return [Check(target.issue, f"{target.text}: not measured, {why}", None, None, False) for target in targets]


def command(bench: Bench, out: Path) -> list[str]:
    return [sys.executable, str(BENCH / bench.script), *bench.args, "--out",
            str(out / bench.out_file if bench.out_file else out)]


def newest_result(out: Path, stem: str, since: float) -> Path | None:
    """The newest `stem-<UTC time>.json` under `out` written at or after `since` (epoch seconds)."""
    pattern = re.compile(rf"{re.escape(stem)}-\d{{8}}T\d{{6}}Z\.json")
    written = [path for path in out.glob(f"{stem}-*.json")
               if pattern.fullmatch(path.name) and path.stat().st_mtime >= since]
    return max(written, key=lambda path: path.name, default=None)


def run_bench(bench: Bench, out: Path, timeout_s: float) -> list[Check]:
    """Run one bench and check its targets on the JSON it wrote."""
    name = f"bench/{bench.script}"
    started = time.time()
    try:
        finished = subprocess.run(command(bench, out), check=False, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return not_measured(bench.targets, f"{name} ran past --timeout-s {timeout_s:g}")
    written = newest_result(out, bench.stem, started)
    if finished.returncode != 0 or written is None:
        wrote = "" if written else f" and wrote no {bench.stem}-*.json"
        return not_measured(bench.targets, f"{name} exited with status {finished.returncode}{wrote}")
    try:
        result = json.loads(written.read_text())
    except (OSError, ValueError) as error:
        return not_measured(bench.targets, f"{written.name} unreadable: {error}")
    return check(bench.targets, result, written.name)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--targets", default=",".join(GROUPS),
                        type=lambda text: [_group(name) for name in text.split(",") if name],
                        help=f"comma-separated groups, of {', '.join(GROUPS)}")
    parser.add_argument("--out", type=Path, default=BENCH / "results" / "kernel_targets",
                        help="directory for kernel-targets-<UTC time>.json / .md and each bench's files")
    parser.add_argument("--timeout-s", type=float, default=600.0, help="longest one bench may run")
    parser.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    return parser.parse_args(argv)


def _group(name: str) -> str:
    if name not in GROUPS:
        raise argparse.ArgumentTypeError(f"unknown target group {name!r} (of {', '.join(GROUPS)})")
    return name


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    benches = [bench for group in args.targets for bench in GROUPS[group]]
    if args.dry_run:
        for bench in benches:
            print(shlex.join(command(bench, args.out)))
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    name = run_name("kernel-targets")
    checks: list[Check] = []
    for bench in benches:
        checks.extend(run_bench(bench, args.out, args.timeout_s))
        write_results(args.out, name, [asdict(check) for check in checks], COLUMNS,
                      summary={"met": sum(check.met for check in checks), "checks": len(checks),
                               "targets": ",".join(args.targets)})
    print(format_table([asdict(check) for check in checks], COLUMNS))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
