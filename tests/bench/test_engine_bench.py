"""bench/engine.py's request mix: the penalised share is spread evenly over the requests."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

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
    bench.run_requests(engine, 16, args, seed=0, penalised_share=args.penalised_share)
    assert [i for i, params in enumerate(engine.params) if params.frequency_penalty != 0.0] == penalised
    assert all(params.max_tokens == 8 and params.ignore_eos for params in engine.params)
