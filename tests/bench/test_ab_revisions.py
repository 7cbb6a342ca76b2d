"""bench/ab_revisions.py: a bench at the working tree and at a prepared commit, in turns."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.fixture
def ab(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    return importlib.import_module("ab_revisions")


def test_each_revision_runs_its_own_bench_over_its_own_libraries(ab, tmp_path, monkeypatch):
    base = ab.prepare("HEAD", tmp_path / "ab")
    assert (base / "libs" / "cleave" / "__init__.py").is_file() and (base / "bench" / "moe.py").is_file()
    (base / "bench" / "where.py").write_text(
        "import cleave, services, subprocess, sys\nprint('cleave at', cleave.__file__)\n"
        "print('services at', services.__file__)\n"  # and where a service process started with -m finds them:
        "subprocess.run([sys.executable, '-m', 'services.where'], check=True)\n")
    (base / "services" / "where.py").write_text("import services\nprint('-m services at', services.__file__)\n")
    run = ab.run_once(ab.Code("HEAD", base), 0, ["where.py"], tmp_path / "out")
    assert run.returncode == 0 and f"cleave at {base / 'libs' / 'cleave' / '__init__.py'}" in run.tail
    assert f"services at {base / 'services' / '__init__.py'}" in run.tail
    assert f"-m services at {base / 'services' / '__init__.py'}" in run.tail, run.tail

    out = tmp_path / "results"
    monkeypatch.chdir(tmp_path)  # a relative --out still names one place for both sides
    runs = ab.main(["--base", "HEAD", "--tree-rev", "tree", "--rounds", "2", "--ab-dir", str(tmp_path / "ab"),
                    "--out", "results", "--", "kernel_targets.py", "--dry-run", "--targets", "gpt_oss", "--out", "{out}"])
    assert [(run.code.rev, run.round) for run in runs] == [("tree", 0), ("HEAD", 0), ("tree", 1), ("HEAD", 1)]
    for run in runs:  # the dry run prints the bench it would start: this side's copy, into this run's directory
        bench = BENCH if run.code.rev == "tree" else base / "bench"
        assert run.returncode == 0 and f"{bench / 'moe.py'} --part decode --model gpt-oss-20b" in run.tail, run.tail
        assert f"{out.resolve()}/ab-" in run.tail and f"{run.code.rev}-{run.round}" in run.tail, run.tail
    (report,) = out.glob("ab-*.md")
    text = report.read_text()
    assert "--tree-rev tree" in text and "| 1 | HEAD | 0 |" in text and "| 0 | tree | 0 |" in text


def test_a_base_that_was_not_prepared_is_named(ab, tmp_path):
    with pytest.raises(SystemExit, match="run --prepare abc123 first"):
        ab.main(["--base", "abc123", "--ab-dir", str(tmp_path), "--out", str(tmp_path), "--", "moe.py"])
    with pytest.raises(SystemExit):  # no bench after '--'
        ab.main(["--base", "abc123"])
