"""bench/engine_host.py and bench/engine_step_gaps.py on CPU with the tiny model: one row per
garbage-collector setting, counts that add up, and no heap left frozen afterwards."""

from __future__ import annotations

import gc
import importlib.util
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
BENCH_MODULES = ("common", "engine", "engine_host", "engine_sweep", "engine_sweep_plot")


def load(name: str):  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[f"bench_{name}"] = module
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


@pytest.fixture
def restore_bench_imports():  # type: ignore[no-untyped-def]
    saved_path = list(sys.path)
    saved_modules = {name: sys.modules[name] for name in BENCH_MODULES if name in sys.modules}
    saved_perf_counter = __import__("time").perf_counter
    try:
        yield
    finally:
        __import__("time").perf_counter = saved_perf_counter  # engine_host's --clock cpu patches it
        for name in ("bench_engine_host", "bench_engine_step_gaps", *BENCH_MODULES):
            sys.modules.pop(name, None)
        sys.modules.update(saved_modules)
        sys.path[:] = saved_path


def table_rows(text: str) -> list[dict[str, str]]:
    """The rows of a markdown table, keyed by its header."""
    lines = [line for line in text.splitlines() if line.startswith("| ")]
    header, *body = ([cell.strip() for cell in line.strip("|").split("|")] for line in lines)
    return [dict(zip(header, row)) for row in body]


@pytest.mark.timeout(300)
def test_engine_host_reports_each_gc_setting(restore_bench_imports, capsys):
    module = load("engine_host")
    args = ["--batch", "4", "--output-len", "24", "--mode", "overlap", "--gc", "both", "--clock", "wall"]
    assert module.main(args) == 0
    rows = table_rows(capsys.readouterr().out)
    assert [(row["mode"], row["gc"]) for row in rows] == [("overlap", "normal"), ("overlap", "frozen")]
    for row in rows:
        assert int(row["steps"]) > 10 and float(row["host"]) > 0 and float(row["host_mean"]) > 0
        assert float(row["gc_ms"]) >= 0 and int(row["full_gcs"]) >= 0
    assert gc.get_freeze_count() == 0


@pytest.mark.timeout(300)
def test_engine_host_with_random_logits_times_only_host_phases(restore_bench_imports, capsys):
    module = load("engine_host")
    args = ["--batch", "4", "--output-len", "24", "--mode", "sync", "--forward", "random", "--clock", "wall"]
    assert module.main(args) == 0
    (row,) = table_rows(capsys.readouterr().out)
    assert (row["mode"], row["gc"]) == ("sync", "normal") and int(row["steps"]) > 10
    assert float(row["detokenize"]) > 0 and float(row["host"]) > 0  # text made while the "forward" ran


@pytest.mark.timeout(300)
def test_engine_step_gaps_on_cpu_has_no_device_wait(restore_bench_imports, capsys):
    module = load("engine_step_gaps")
    args = ["--device", "cpu", "--batch", "4", "--prompt-len", "8", "--output-len", "24", "--freeze", "both"]
    assert module.main(args) == 0
    lines = capsys.readouterr().out.splitlines()
    header = max(index for index, line in enumerate(lines) if line.split()[:2] == ["batch", "freeze"])  # the summary
    rows = [line.split() for line in lines[header + 1 : header + 3]]
    assert [row[:2] for row in rows] == [["4", "False"], ["4", "True"]]
    for row in rows:
        steps, step_ms, wait_ms, host_ms = int(row[2]), float(row[3]), float(row[6]), float(row[7])
        assert steps > 10 and wait_ms == 0.0 and host_ms == step_ms > 0  # no device events on CPU
    assert gc.get_freeze_count() == 0
