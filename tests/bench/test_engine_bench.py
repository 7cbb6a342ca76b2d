"""bench/engine.py's request mix: the penalised share is spread evenly over the requests."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

import cleave
from tests.bench.bench_modules import bench_fixture

bench = bench_fixture("engine")


class RecordingEngine:
    """Takes requests and finishes at once: what `run_requests` submitted, nothing run."""

    def __init__(self) -> None:
        self.model_config = SimpleNamespace(vocab_size=1000)
        self.params: list = []

    def add_request(self, request_id, prompt, params) -> None:
        self.params.append(params)

    def has_unfinished(self) -> bool:
        return False


@pytest.mark.parametrize(("share", "penalised"), [(0.0, []), (0.25, [3, 7, 11, 15]), (1.0, list(range(16)))])
def test_penalised_requests_are_spread_evenly(bench, share, penalised):
    engine = RecordingEngine()
    args = bench.parse_args(["--prompt-len", "4", "--output-len", "8", "--penalised-share", str(share)])
    (penalised_share,) = args.penalised_share
    bench.run_requests(engine, 16, args, seed=0, penalised_share=penalised_share)
    assert [i for i, params in enumerate(engine.params) if params.frequency_penalty != 0.0] == penalised
    assert all(params.max_tokens == 8 and params.ignore_eos for params in engine.params)


def test_the_step_log_names_its_fields_and_marks_graph_replays(bench):
    from cleave.engine.model_runner import StepStats

    eager = StepStats(num_seqs=3, num_tokens=40, wall_s=0.0021, device_s=0.0019, forward_s=0.001, postprocess_s=0.0002)
    replayed = StepStats(num_seqs=3, num_tokens=3, wall_s=0.001, used_graph=True)
    log = bench.step_log([eager, replayed])
    assert [dict(zip(bench.STEP_LOG_FIELDS, row)) for row in log] == [
        {"seqs": 3, "tokens": 40, "wall_ms": 2.1, "device_ms": 1.9, "forward_ms": 1.0, "postprocess_ms": 0.2, "graph": 0},
        {"seqs": 3, "tokens": 3, "wall_ms": 1.0, "device_ms": 0.0, "forward_ms": 0.0, "postprocess_ms": 0.0, "graph": 1},
    ]


def test_attention_launches_name_each_throughput_run(bench):
    """`--attention-launches`: '{}' (the default launch) unless given; a run is named by what
    the command varies."""
    assert bench.parse_args([]).attention_launches == [{}]
    args = bench.parse_args(["--attention-launches", "{}", '{"decode_rows": true}'])
    assert args.attention_launches == [{}, {"decode_rows": True}]
    assert bench.run_label("overlap", None, None) == "overlap"
    assert bench.run_label("overlap", 0.1, {}) == "overlap penalised 0.1 attention default"
    assert bench.run_label("sync", None, {"decode_rows": True}) == 'sync attention {"decode_rows":true}'
    assert bench.parse_args([]).sampler_impls == ["auto"]
    assert bench.run_label("overlap", None, None, "auto") == "overlap sampler auto"


def test_kv_cache_dtypes_reach_the_engine_config_and_name_each_run(bench, monkeypatch):
    """`--kv-cache-dtypes auto fp8`: each run's engine is built with its cache dtype, and the
    run's name says which when several are compared."""
    import cleave.engine.llm_engine as llm_engine

    assert bench.parse_args([]).kv_cache_dtypes == ["auto"]
    assert bench.parse_args(["--kv-cache-dtypes", "auto", "fp8"]).kv_cache_dtypes == ["auto", "fp8"]
    assert bench.run_label("overlap", None, None, None, "fp8") == "overlap kv fp8"
    built = []
    monkeypatch.setattr(llm_engine, "LLMEngine", lambda config, **kwargs: built.append(config))
    args = bench.parse_args(["--device", "cpu"])
    reasoner = Path(cleave.__file__).parent / "assets" / "reasoner"  # any checkpoint: the engine is not built
    bench.make_engine(reasoner, args, 4, "overlap", kv_cache_dtype="fp8")
    assert built[0].cache.kv_cache_dtype == "fp8"
