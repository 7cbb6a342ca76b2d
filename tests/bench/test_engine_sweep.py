"""bench/engine_sweep.py: a CPU sweep with a tiny model writes one row per mix x batch,
skips points whose KV does not fit, survives a failing point, and draws its PNG."""

from __future__ import annotations

import importlib
import importlib.util
import json
import re
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
BENCH_MODULES = ("common", "engine", "engine_sweep_plot")  # what the sweep imports from bench/


@pytest.fixture
def sweep():  # type: ignore[no-untyped-def]
    """The sweep module, with bench/ importable; sys.path and bench's modules restored after."""
    saved_path = list(sys.path)
    saved_modules = {name: sys.modules[name] for name in BENCH_MODULES if name in sys.modules}
    spec = importlib.util.spec_from_file_location("bench_engine_sweep", BENCH / "engine_sweep.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_engine_sweep"] = module  # its dataclasses look their module up while being built
    try:
        spec.loader.exec_module(module)  # type: ignore[union-attr]
        module.ensure_bench_importable()
        yield module
    finally:
        sys.modules.pop("bench_engine_sweep", None)
        for name in BENCH_MODULES:
            sys.modules.pop(name, None)
        sys.modules.update(saved_modules)
        sys.path[:] = saved_path


def test_defaults_are_the_issue_sweep_and_cpu_is_a_smoke_run(sweep):
    gpu = sweep.parse_args([])
    assert [mix.label for mix in gpu.mixes] == ["128/2048", "2048/128", "512/1024"]
    assert gpu.batches == [1, 8, 32, 64, 128, 192, 256, 384, 512]
    assert (gpu.model, gpu.dtype, gpu.modes, gpu.max_model_len) == ("llama-1b", "bfloat16", ["overlap"], 2176)
    cpu = sweep.parse_args(["--device", "cpu"])
    assert [mix.label for mix in cpu.mixes] == ["8/8"] and cpu.batches == [1, 2]
    assert (cpu.model, cpu.dtype) == ("tiny", "float32")
    assert sweep.parse_args(["--batches", "8,1,8"]).batches == [1, 8]


@pytest.mark.parametrize("flags", [["--mixes", "128"], ["--mixes", "0/16"], ["--batches", "1,x"], ["--modes", "fast"]])
def test_bad_flags_are_refused(sweep, flags, capsys):
    with pytest.raises(SystemExit):
        sweep.parse_args(flags)
    assert flags[0] in capsys.readouterr().err


@pytest.mark.timeout(120)
def test_cpu_sweep_writes_one_row_per_point_and_a_png(sweep, tmp_path):
    # 3 blocks = the null block + 2 usable, one per sequence: batch 4 cannot hold its KV
    argv = ["--device", "cpu", "--mixes", "8/8,4/6", "--batches", "1,2,4", "--num-blocks", "3", "--out", str(tmp_path)]
    assert sweep.main(argv) == 0
    (json_path,) = tmp_path.glob("engine-sweep-*.json")
    assert re.fullmatch(r"engine-sweep-\d{8}T\d{6}Z\.json", json_path.name)
    result = json.loads(json_path.read_text())
    rows = result["rows"]
    assert [(row["mix"], row["batch"]) for row in rows] == [
        ("8/8", 1), ("8/8", 2), ("8/8", 4), ("4/6", 1), ("4/6", 2), ("4/6", 4)]
    measured = [row for row in rows if row["batch"] < 4]
    for row in measured:
        assert row["status"] == "ok" and row["mode"] == "overlap"
        assert row["output_tokens"] == row["batch"] * row["output_len"]  # every token of every request
        assert row["output_tokens_per_s"] > 0 and row["step_ms"] > 0
        assert row["steady_seqs"] == row["batch"] and row["steady_steps"] >= row["output_len"] - 1
        assert row["gpu_idle_pct"] is None and row["preemptions"] == 0  # no CUDA events on CPU
    for row in rows[2], rows[5]:
        assert row["status"] == "skipped" and "need 4 KV blocks; the cache has 2" in row["reason"]
    summary = result["summary"]
    assert summary["engine_loads_overlap"] == 1 and summary["max_num_seqs"] == 4  # loaded once for the sweep
    assert "engine_sweep.py" in result["command"] and "--num-blocks 3" in result["command"]
    assert result["machine"]["date"] and result["machine"]["device"] == "cpu"
    markdown = json_path.with_suffix(".md").read_text()
    assert markdown.startswith(f"# {json_path.stem}") and "| overlap | 4/6 | 4 | skipped |" in markdown
    png = json_path.with_suffix(".png")
    assert summary["plot"] == png.name and png.read_bytes()[:8] == PNG_MAGIC


@pytest.mark.timeout(120)
def test_a_failing_point_is_recorded_and_the_engine_reloaded(sweep, tmp_path, monkeypatch):
    engine_bench = importlib.import_module("engine")
    run_requests = engine_bench.run_requests

    def fail_at_batch_two(engine, num_requests, args, seed):  # type: ignore[no-untyped-def]
        if num_requests == 2:
            raise RuntimeError("device lost")
        return run_requests(engine, num_requests, args, seed)

    monkeypatch.setattr(engine_bench, "run_requests", fail_at_batch_two)
    assert sweep.main(["--device", "cpu", "--mixes", "4/4,4/3", "--batches", "1,2", "--out", str(tmp_path)]) == 0
    (json_path,) = tmp_path.glob("engine-sweep-*.json")
    result = json.loads(json_path.read_text())
    statuses = [(row["mix"], row["batch"], row["status"]) for row in result["rows"]]
    assert statuses == [("4/4", 1, "ok"), ("4/4", 2, "error"), ("4/3", 1, "ok"), ("4/3", 2, "error")]
    assert result["rows"][1]["reason"] == "RuntimeError: device lost"
    assert result["rows"][2]["output_tokens"] == 3  # the reloaded engine measured the next point
    assert result["summary"]["engine_loads_overlap"] == 2  # once at the start, once after the first failure


def test_without_matplotlib_the_plot_is_skipped_with_a_message(sweep, tmp_path, monkeypatch, capsys):
    plot = importlib.import_module("engine_sweep_plot")
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    rows = [{"mode": "overlap", "mix": "8/8", "batch": 1, "status": "ok", "output_tokens_per_s": 10.0}]
    assert plot.plot_sweep(rows, tmp_path / "sweep.png") is None
    assert "matplotlib is not installed" in capsys.readouterr().err and not (tmp_path / "sweep.png").exists()
