"""bench/kernel_targets.py: every check on recorded runs (the result files under bench/results,
never rewritten), runs that lack what a target needs, the commands it would run, and the
runner over stand-in benches (one that writes its JSON, one that fails, one that hangs)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.bench.bench_modules import bench_fixture

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "bench" / "results"

bench = bench_fixture("kernel_targets")


def recorded(path: str) -> dict:
    return json.loads((RESULTS / path).read_text())


def verdicts(checks) -> list[tuple[float | None, float | None, bool]]:  # type: ignore[no-untyped-def]
    return [(check.measured, check.bound, check.met) for check in checks]


def test_engine_targets_on_the_h100_run_of_four_variants(bench):
    result = recorded("engine/engine-20261205T112919Z.json")
    best = bench.check(bench.engine_targets('overlap attention {"decode_rows":true} sampler auto'), result, "e.json")
    # 48.8k tok/s misses 50k; idle 2.0% at batch 193-256 and no compile in the run meet theirs
    assert verdicts(best) == [(48804.6, 50000.0, False), (2.039, 5.0, True), (0.0, 0.0, True)]
    assert {check.result for check in best} == {"e.json"} and all(c.issue == bench.ENGINE_ISSUE for c in best)
    torch_sampler = bench.check(bench.engine_targets("overlap attention default sampler torch"), result, "e.json")
    assert verdicts(torch_sampler) == [(38649.9, 50000.0, False), (4.071, 5.0, True), (3.0, 0.0, False)]
    # the runner's own run is labelled "overlap" (one variant): this file has no such run
    missing = bench.check(bench.engine_targets(), result, "e.json")
    assert [check.met for check in missing] == [False] * 3 and all(check.measured is None for check in missing)
    assert "no output_tokens_per_s_overlap in the run's summary" in missing[0].target
    assert "no row with mode=overlap, batch=decode 193-4096" in missing[1].target


def test_engine_run_from_before_compile_counting_fails_that_target_alone(bench):
    checks = bench.check(bench.engine_targets(), recorded("engine/engine-20261204T192731Z.json"), "e.json")
    assert verdicts(checks)[:2] == [(34484.8, 50000.0, False), (0.557, 5.0, True)]
    assert not checks[2].met and "no compiles_in_run_overlap in the run's summary" in checks[2].target
    short = recorded("engine/engine-20261204T192731Z.json")
    short["summary"]["output_len"] = 128
    assert all("the run's output_len is 128, not 1024" in c.target for c in bench.check(bench.engine_targets(),
                                                                                       short, ""))


def test_decode_targets_read_the_graph_rows_pipelined_time(bench):
    one_k, long_context = (b.targets for b in bench.GROUPS["decode"])
    table = recorded("decode/decode.json")  # the H200 table with deferred norms, every case
    assert verdicts(bench.check(one_k, table, "d.json")) == [(797.0, 700.0, False), (1629.9, 1450.0, False)]
    assert verdicts(bench.check(long_context, table, "d.json")) == [(96.1, 85.0, True)]
    (missing,) = bench.check(long_context, recorded("decode/decode-20261203T214739Z.json"), "d.json")  # 1 and 64 / 1k
    assert not missing.met and "no row with mode=graph, batch=32, context=32768" in missing.target


def test_prefill_targets_need_8192_tokens_and_transformers_in_the_run(bench):
    (targets,) = (b.targets for b in bench.GROUPS["prefill"])
    result = recorded("prefill.json")  # 47.6 ms; transformers-sdpa 49.2 ms
    assert verdicts(bench.check(targets, result, "p.json")) == [(47.588, 40.0, False),
                                                                (47.588, round(49.233 / 1.25, 3), False)]
    result["results"] = [row for row in result["results"] if row["name"] != "transformers-sdpa"]
    own, against = bench.check(targets, result, "p.json")
    assert own.measured == 47.588 and not against.met and "no row with name=transformers-sdpa" in against.target
    short = bench.check(targets, recorded("prefill/prefill-20261204T174754Z.json"), "p.json")  # 512, cleave only
    assert [check.met for check in short] == [False, False]
    assert all("the run prefilled 512 tokens, not 8192" in check.target for check in short)


def test_moe_decode_targets(bench):
    (qwen,) = (b.targets for b in bench.GROUPS["moe_decode"])
    (gpt_oss,) = (b.targets for b in bench.GROUPS["gpt_oss"])
    qwen_run = recorded("moe/moe-decode-20261205T052536Z.json")
    # batch 1: 3338 us against 2200, not met; batch 64: 83.0% of its touched experts' roofline, met
    assert verdicts(bench.check(qwen, qwen_run, "q.json")) == [(3338.24, 2200.0, False), (82.971, 70.0, True)]
    gpt_oss_run = recorded("moe/moe-decode-20261205T052557Z.json")
    (within,) = bench.check(gpt_oss, gpt_oss_run, "g.json")  # 2616.2 us against 1.5 x 1700.2: 1.54x
    assert (within.measured, within.bound, within.met) == (2616.192, 2550.32, False)
    wrong_model = bench.check(qwen, gpt_oss_run, "g.json")
    assert all(not c.met and "the run is of the gpt-oss shape, not qwen3-moe" in c.target for c in wrong_model)
    (wrong_model,) = bench.check(gpt_oss, qwen_run, "q.json")
    assert not wrong_model.met and "the run is of the qwen3-moe shape, not gpt-oss" in wrong_model.target


def test_moe_layer_targets_against_the_faster_baseline(bench):
    (targets,) = (b.targets for b in bench.GROUPS["moe_layer"])
    full = recorded("moe/moe-layer-20261203T214817Z.json")  # every method at 1-8192 tokens (no shape architecture)
    checks = bench.check(targets, full, "l.json")
    assert [check.met for check in checks] == [True] * 5
    assert verdicts(checks)[0] == (291.68, 2286.112, True)  # 1 token: transformers 2286 us beats compile's 3668
    assert verdicts(checks)[-1] == (2388.864, 32206.818, True)
    rows = full["rows"]
    failed = next(row for row in rows if row["tokens"] == 8192 and row["method"] == "transformers")
    failed.clear()
    failed.update(tokens=8192, method="transformers", error="OutOfMemoryError: CUDA out of memory")
    last = bench.check(targets, full, "l.json")[-1]
    assert not last.met and "has no us: OutOfMemoryError: CUDA out of memory" in last.target
    partial = bench.check(targets, recorded("moe/moe-layer-20261205T040729Z.json"), "l.json")  # 1-4 tokens, no baselines
    assert "no row with tokens=1, method=transformers" in partial[0].target
    assert all(not check.met and check.measured is None for check in partial)


def test_moe_prefill_target(bench):
    (targets,) = (b.targets for b in bench.GROUPS["moe_prefill"])
    (check,) = bench.check(targets, recorded("moe/moe-prefill-20261205T042039Z.json"), "m.json")
    assert (check.measured, check.bound, check.met) == (40.918, 50.0, False)  # 323 TFLOP/s: 41% of 790


def test_a_dry_run_prints_each_bench_command(tmp_path):
    script = str(ROOT / "bench" / "kernel_targets.py")
    finished = subprocess.run([sys.executable, script, "--dry-run", "--out", str(tmp_path)],
                              capture_output=True, text=True, timeout=120)
    assert finished.returncode == 0, finished.stderr
    lines = [line.split(" ", 1)[1] for line in finished.stdout.splitlines()]  # without the interpreter
    bench_dir, out = ROOT / "bench", tmp_path
    assert lines == [
        f"{bench_dir}/engine.py --modes overlap --breakdown-batch 0 --out {out}",
        f"{bench_dir}/decode.py --batches 1,64 --contexts 1024 --out {out}",
        f"{bench_dir}/decode.py --batches 32 --contexts 32768 --out {out}",
        f"{bench_dir}/prefill.py --tokens 8192 --out {out}/prefill.json",
        f"{bench_dir}/moe.py --part decode --batch 1,64 --context 1024 --out {out}",
        f"{bench_dir}/moe.py --part decode --model gpt-oss-20b --batch 1 --context 1024 --out {out}",
        f"{bench_dir}/moe.py --part layer --tokens 1,16,64,512,8192 --out {out}",
        f"{bench_dir}/moe.py --part prefill --prefill-tokens 8192 --out {out}",
    ]
    some = subprocess.run([sys.executable, script, "--dry-run", "--targets", "gpt_oss,prefill", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=120)
    assert [line.split(" ")[1:3] for line in some.stdout.splitlines()] == [
        [f"{bench_dir}/moe.py", "--part"], [f"{bench_dir}/prefill.py", "--tokens"]]
    refused = subprocess.run([sys.executable, script, "--dry-run", "--targets", "moe", "--out", str(tmp_path)],
                             capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2 and "unknown target group 'moe'" in refused.stderr
    assert not list(tmp_path.iterdir())  # a dry run writes nothing


STAND_IN_DECODE = """
import datetime, json, sys
from pathlib import Path
if "32768" in sys.argv:
    sys.exit(3)  # the long-context run fails
out = Path(sys.argv[sys.argv.index("--out") + 1])
stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
rows = [{"mode": "graph", "batch": 1, "context": 1024, "pipelined_ms": 0.65},
        {"mode": "graph", "batch": 64, "context": 1024, "pipelined_ms": 1.5}]
(out / f"decode-{stamp}.json").write_text(json.dumps({"summary": {}, "rows": rows}))
"""


def test_the_runner_checks_what_each_bench_wrote_and_goes_on_past_failures(bench, tmp_path, monkeypatch):
    scripts, out = tmp_path / "bench", tmp_path / "out"
    scripts.mkdir()
    out.mkdir()
    (scripts / "decode.py").write_text(textwrap.dedent(STAND_IN_DECODE))
    (scripts / "engine.py").write_text("import time\ntime.sleep(60)\n")
    stale = out / "decode-29991231T235959Z.json"  # sorts newest, but was there before the run
    stale.write_text(json.dumps({"rows": [{"mode": "graph", "batch": 1, "context": 1024, "pipelined_ms": 0.1}]}))
    os.utime(stale, (1e9, 1e9))
    monkeypatch.setattr(bench, "BENCH", scripts)

    assert bench.main(["--targets", "decode,engine", "--out", str(out), "--timeout-s", "3"]) == 0
    (written,) = out.glob("kernel-targets-*.json")
    rows = json.loads(written.read_text())["rows"]
    assert [(row["measured"], row["bound"], row["met"]) for row in rows[:2]] == [(650.0, 700.0, True),
                                                                                 (1500.0, 1450.0, False)]
    assert rows[0]["result"].startswith("decode-") and rows[0]["result"] != stale.name
    assert "not measured, bench/decode.py exited with status 3 and wrote no decode-*.json" in rows[2]["target"]
    assert all("not measured, bench/engine.py ran past --timeout-s 3" in row["target"] for row in rows[3:])
    assert len(rows) == 6 and [row["met"] for row in rows[2:]] == [False] * 4
    assert json.loads(written.read_text())["summary"]["met"] == 1
    assert (written.with_suffix(".md")).read_text().count("| the engine keeps the GPU busy |") == 6


@pytest.mark.parametrize("name", ["decode-20261205T000000Z.json", "decode-ab-20261205T000000Z.json"])
def test_only_the_bench_s_own_stem_counts_as_its_result(bench, tmp_path, name):
    (tmp_path / name).write_text("{}")
    found = bench.newest_result(tmp_path, "decode", since=0.0)
    assert (found.name if found else None) == (name if name.startswith("decode-2026") else None)
