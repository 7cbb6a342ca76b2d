"""bench/common.py: result naming (every run writes new files, stamped with its UTC time) and prefill launches."""

from __future__ import annotations

import ast
import datetime
import json
from pathlib import Path

from tests.bench.bench_modules import BENCH, bench_fixture

# Scripts that still pass a fixed stem to write_results; each reruns over its last result.
FIXED_NAME_SCRIPTS: set[str] = set()


common = bench_fixture("common")


def test_run_name_and_path_carry_the_utc_time(common):
    moment = datetime.datetime(2026, 12, 3, 20, 45, 39, tzinfo=datetime.timezone(datetime.timedelta(hours=2)))
    assert common.run_name("decode", moment) == "decode-20261203T184539Z"
    assert common.run_path("results/prefill.json", moment) == Path("results/prefill-20261203T184539Z.json")
    assert common.run_path("results/test_time_scaling", moment) == Path("results/test_time_scaling-20261203T184539Z")


def test_two_runs_leave_the_committed_result_and_each_other_alone(common, tmp_path):
    committed = tmp_path / "decode.json"
    committed.write_text('{"rows": ["committed"]}')
    first = datetime.datetime(2026, 12, 3, 18, 45, 39, tzinfo=datetime.timezone.utc)
    for offset, value in enumerate(("first", "second")):
        name = common.run_name("decode", first + datetime.timedelta(seconds=offset))
        common.write_results(tmp_path, name, [{"value": value}], ["value"], argv=["bench/decode.py"])
    assert json.loads(committed.read_text()) == {"rows": ["committed"]}
    written = sorted(path.name for path in tmp_path.glob("decode-*.json"))
    assert written == ["decode-20261203T184539Z.json", "decode-20261203T184540Z.json"]
    assert json.loads((tmp_path / written[1]).read_text())["rows"] == [{"value": "second"}]
    assert (tmp_path / "decode-20261203T184540Z.md").read_text().startswith("# decode-20261203T184540Z")


def test_results_name_the_code_they_ran(common, tmp_path, monkeypatch):
    import subprocess

    monkeypatch.delenv(common.CODE_REV_ENV, raising=False)
    head = subprocess.run(["git", "-C", str(common.REPO), "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True).stdout.strip()
    if head:  # a checkout (CI's clean clone is one): its commit, marked when tracked files differ
        assert common.code_revision().split("+")[0] == head
    monkeypatch.setenv(common.CODE_REV_ENV, "abc1234")  # a tree copied without its history
    assert common.code_revision() == "abc1234"
    common.write_results(tmp_path, "run", [{"value": 1}], ["value"], argv=["bench/x.py"])
    assert "- code: abc1234" in (tmp_path / "run.md").read_text()
    assert json.loads((tmp_path / "run.json").read_text())["machine"]["code"] == "abc1234"


def fixed_result_names(script: Path) -> list[int]:
    """Lines where `script` passes a literal (or f-string) stem to write_results."""
    lines = []
    for node in ast.walk(ast.parse(script.read_text())):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "write_results" and len(node.args) > 1:
            if isinstance(node.args[1], (ast.Constant, ast.JoinedStr)):
                lines.append(node.lineno)
    return lines


def test_bench_scripts_name_results_per_run():
    offenders = {script.name: fixed_result_names(script) for script in sorted(BENCH.glob("*.py"))
                 if script.name not in FIXED_NAME_SCRIPTS}
    assert {name: lines for name, lines in offenders.items() if lines} == {}


def test_prefill_launches_from_json_reach_every_layer_over_its_default(common):
    from dataclasses import replace

    from cleave.model.llama import CausalLM
    from tests.graphs.test_runner import tiny_config

    model = CausalLM(tiny_config())
    default = model.layers[0].self_attn.prefill_launch  # tuned for the head size
    common.set_prefill_launch(model, {"pack_gqa": True, "block_m": 64})
    assert all(layer.self_attn.prefill_launch == replace(default, pack_gqa=True, block_m=64) for layer in model.layers)
    common.set_prefill_launch(model, {})
    assert all(layer.self_attn.prefill_launch == default for layer in model.layers)
    assert common.launch_label({"pack_gqa": True, "block_m": 128}) == '{"block_m":128,"pack_gqa":true}'


def test_rounds_fold_into_each_cases_lowest_times(common):
    best: dict = {}
    common.keep_lowest(best, "a", {"case": "a", "mean": 3.0, "worst": 9.0, "round": 0}, ("mean", "worst"))
    common.keep_lowest(best, "b", {"case": "b", "mean": 5.0, "worst": 5.0, "round": 0}, ("mean", "worst"))
    common.keep_lowest(best, "a", {"case": "a", "mean": 4.0, "worst": 2.0, "round": 1}, ("mean", "worst"))
    assert best == {"a": {"case": "a", "mean": 3.0, "worst": 2.0, "round": 1},
                    "b": {"case": "b", "mean": 5.0, "worst": 5.0, "round": 0}}


def test_nearest_rank_takes_a_value_of_the_list_without_interpolating(common):
    values = [5.0, 1.0, 4.0, 2.0, 3.0]
    assert common.nearest_rank(values, 0.5) == 3.0 and common.nearest_rank(values, 0.99) == 5.0
    assert common.nearest_rank(values, 0.0) == 1.0 and common.nearest_rank([], 0.5) is None
    assert common.nearest_rank([1.234567], 0.5, 1) == 1.2
