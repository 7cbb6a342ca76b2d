"""One bench at two code revisions on one machine, in turns: the working tree against a commit.

A lent GPU machine gets a copy of the working tree without its git history, so the commit's
code travels as files. Here, before the device call (`.ab/` is ignored by git; carry it):

    python bench/ab_revisions.py --prepare ba2b575

writes `git archive ba2b575 libs bench services` to `.ab/ba2b575/`. Then, on the device:

    python bench/ab_revisions.py --base ba2b575 --rounds 2 --out $OUT/ab -- \\
        moe.py --part decode --batch 1 --out {out}

runs `bench/moe.py ...` over the tree's libraries and `.ab/ba2b575/bench/moe.py ...` over the
commit's, alternating for `--rounds` rounds, each in a subprocess whose `PYTHONPATH` starts
with that code's `libs` and then its root (its `services`, for benches that start the
service processes, which inherit it) and whose `CLEAVE_CODE_REV` names it (the tree's from `--tree-rev`,
else `CLEAVE_CODE_REV`, else git's), so every result file says which code made it. `{out}` in
the bench's arguments becomes that run's own directory, `--out/<rev>-<round>/`. It prints each
run's last lines and writes `ab-<UTC time>.md` under `--out`: the command, the machine and, per
run, its code, exit status, seconds and result files. Compare numbers only within one such file.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tarfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from io import BytesIO
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import code_revision, machine_info, run_name  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
AB_DIR = ROOT / ".ab"  # the prepared revisions (ignored by git)
TAIL_LINES = 12


@dataclass(frozen=True)
class Code:
    """One side of the comparison: its revision name and the directory holding its libs/, bench/
    and services/."""

    rev: str
    root: Path


@dataclass(frozen=True)
class Run:
    code: Code
    round: int
    returncode: int
    seconds: float
    files: list[Path]
    tail: str


def prepare(rev: str, ab_dir: Path = AB_DIR) -> Path:
    """`git archive REV libs bench services` unpacked into `ab_dir/REV` (replacing what was there)."""
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev, "libs", "bench", "services"], check=True,
                             capture_output=True).stdout
    target = ab_dir / rev
    shutil.rmtree(target, ignore_errors=True)
    target.mkdir(parents=True)
    with tarfile.open(fileobj=BytesIO(archive)) as tar:
        tar.extractall(target, filter="data")
    return target


def run_once(code: Code, round_index: int, bench_args: Sequence[str], out: Path) -> Run:
    """The bench of `code` in a subprocess over its own libraries; `{out}` in its arguments is
    this run's directory."""
    run_dir = out / f"{code.rev}-{round_index}"
    run_dir.mkdir(parents=True, exist_ok=True)
    script, *rest = bench_args
    args = [arg.replace("{out}", str(run_dir)) for arg in rest]
    roots = dict.fromkeys([str(code.root / "libs"), str(code.root), str(ROOT)])  # the tree's root: tests/ for some
    paths = [*roots, *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    env = {**os.environ, "CLEAVE_CODE_REV": code.rev, "PYTHONPATH": os.pathsep.join(paths)}
    before = set(run_dir.rglob("*"))
    start = time.monotonic()
    # in its own root: `python -m services.X` (a bench starting services) puts the directory first
    result = subprocess.run([sys.executable, str(code.root / "bench" / script), *args], env=env, cwd=code.root,
                            capture_output=True, text=True)
    seconds = time.monotonic() - start
    files = sorted(path for path in set(run_dir.rglob("*")) - before if path.is_file())
    tail = "\n".join((result.stdout + result.stderr).strip().splitlines()[-TAIL_LINES:])
    return Run(code, round_index, result.returncode, seconds, files, tail)


def report(runs: Sequence[Run], command: str, out: Path) -> Path:
    lines = [f"# {out.name}", "", f"- command: `{command}`",
             *(f"- {key}: {value}" for key, value in asdict(machine_info()).items()), "",
             "| round | code | exit | seconds | result files |", "|---|---|---|---|---|"]
    for run in runs:
        files = ", ".join(f"`{path.relative_to(out.parent)}`" for path in run.files) or "none"
        lines.append(f"| {run.round} | {run.code.rev} | {run.returncode} | {run.seconds:.1f} | {files} |")
    path = out.parent / f"{out.name}.md"
    path.write_text("\n".join(lines) + "\n")
    return path


def parse_args(argv: Sequence[str] | None) -> tuple[argparse.Namespace, list[str]]:
    argv = list(sys.argv[1:] if argv is None else argv)
    bench_args = argv[argv.index("--") + 1:] if "--" in argv else []
    own = argv[: argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prepare", metavar="REV", help="write REV's libs and bench under .ab/REV and stop")
    parser.add_argument("--base", metavar="REV", help="the prepared revision to compare against")
    parser.add_argument("--tree-rev", default=None, help="the working tree's name in the results (default: "
                        "`common.code_revision`: CLEAVE_CODE_REV, else git's)")
    parser.add_argument("--rounds", type=int, default=1, help="tree then base, this many times")
    parser.add_argument("--ab-dir", type=Path, default=AB_DIR, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "ab")
    args = parser.parse_args(own)
    if args.prepare is None and (args.base is None or not bench_args):
        parser.error("give --prepare REV, or --base REV and the bench after '--'")
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    return args, bench_args


def main(argv: Sequence[str] | None = None) -> list[Run]:
    args, bench_args = parse_args(argv)
    if args.prepare is not None:
        print(f"prepared {prepare(args.prepare, args.ab_dir)}")
        return []
    base_root = args.ab_dir / args.base
    if not (base_root / "bench" / bench_args[0]).is_file():
        raise SystemExit(f"{base_root / 'bench' / bench_args[0]} is missing: run --prepare {args.base} first "
                         "(and carry .ab to the device)")
    codes = [Code(args.tree_rev or code_revision(), ROOT),
             Code(args.base, base_root)]
    out = args.out.resolve() / run_name("ab")  # absolute: each side runs in its own root
    runs = []
    for round_index in range(args.rounds):
        for code in codes:
            run = run_once(code, round_index, bench_args, out)
            print(f"== {code.rev} round {round_index}: exit {run.returncode}, {run.seconds:.1f} s\n{run.tail}", flush=True)
            runs.append(run)
    command = " ".join(["python", "bench/ab_revisions.py", *(argv if argv is not None else sys.argv[1:])])
    print(f"wrote {report(runs, command, out)}")
    return runs


if __name__ == "__main__":
    main()
