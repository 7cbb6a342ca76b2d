"""`run_serve_bench` in process against the scripted server: files, notes, sweeps."""

from __future__ import annotations

import io
import json

from cleave.benchmark import serve
from cleave.benchmark.client import EndpointSpec
from cleave.benchmark.serve import Output, RandomWorkload, ServeBenchConfig, run_serve_bench


async def test_without_matplotlib_one_note_and_no_plot(fake_server, tmp_path, monkeypatch):
    monkeypatch.setattr(serve, "plotting_available", lambda: False)
    _, url = await fake_server(behaviour="no_usage")
    config = ServeBenchConfig(endpoint=EndpointSpec(base_url=url), workload=RandomWorkload(8, 3), num_prompts=4,
                              result_dir=tmp_path, command="cleave bench serve ...")
    out, err = io.StringIO(), io.StringIO()
    assert await run_serve_bench(config, Output(out, err)) == 0
    notes = [line for line in err.getvalue().splitlines() if "matplotlib" in line]
    assert notes == ["note: matplotlib is not installed, so no plot is drawn (pip install matplotlib)"]
    (result_file,) = tmp_path.iterdir()
    assert result_file.suffix == ".json"
    result = json.loads(result_file.read_text())
    assert result["endpoint"]["model"] == "fake-model"  # the first of /v1/models
    assert result["probe_requests"] == 1 and result["request_rate"] == "inf"
    assert result["summary"]["total_output_tokens"] == 12  # counted by chunks: no usage
    assert "Successful requests:" in out.getvalue()


async def test_sweep_runs_each_rate_and_writes_the_table(fake_server, tmp_path, monkeypatch):
    monkeypatch.setattr(serve, "plotting_available", lambda: False)
    fake, url = await fake_server()
    config = ServeBenchConfig(endpoint=EndpointSpec(base_url=url, model="m"), workload=RandomWorkload(8, 2),
                              num_prompts=3, request_rates=(50.0, 100.0), result_dir=tmp_path, command="c")
    out = io.StringIO()
    assert await run_serve_bench(config, Output(out, io.StringIO())) == 0
    assert len(fake.bodies) == 1 + 2 * 3  # the probe, then each rate's requests
    sweep_json = next(tmp_path.glob("bench-serve-sweep-*.json"))
    assert [run["request_rate"] for run in json.loads(sweep_json.read_text())["runs"]] == [50.0, 100.0]
    table = sweep_json.with_suffix(".md").read_text()
    assert "| 50 | 3 | 0 |" in table and "| 100 | 3 | 0 |" in table
    assert len(list(tmp_path.glob("bench-serve-2*.json"))) == 2
