"""bench/sampler.py: the two paths it times draw the same seeded tokens (timing needs a GPU)."""

from __future__ import annotations

import torch

from tests.bench.bench_modules import bench_fixture

bench = bench_fixture("sampler")


def test_both_paths_sample_the_same_seeded_rows(bench):
    from cleave.engine.sampler import Sampler

    args = bench.parse_args(["--batch", "3", "--vocab-size", "500"])
    assert args.seeded == ["off", "on"] and set(bench.PATHS.values()) == {"torch", "triton"}
    state = bench.sampling_state(3, 500, 0.7, True, torch.device("cpu"))
    assert state.seeded_rows.tolist() == [0, 1, 2]
    logits = torch.randn(3, 500, generator=torch.Generator().manual_seed(0))
    tokens = {impl: Sampler(seed=0, impl=impl).sample(logits, state).token_ids for impl in bench.PATHS.values()}
    assert torch.equal(tokens["torch"], tokens["triton"])
