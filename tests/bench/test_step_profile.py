"""bench/step_profile.py: a call's matrix products grouped by shape (host times on the CPU)."""

from __future__ import annotations

import torch

from tests.bench.bench_modules import bench_fixture

profile = bench_fixture("step_profile")


def test_products_are_grouped_by_shape_and_counted_per_call(profile):
    x = torch.randn(16, 32)
    up, down = torch.nn.Linear(32, 48, bias=False), torch.nn.Linear(48, 32)  # mm, then addmm (the bias)

    def step() -> torch.Tensor:
        return down(up(x)) + down(up(x))

    with torch.inference_mode():
        rows = profile.gemm_rows(step, peak_tflops=1.0, calls=2)
    assert {row["shape"]: row["calls"] for row in rows} == {"16x32x48": 2.0, "16x48x32": 2.0}
    assert abs(sum(row["pct_of_gemm_time"] for row in rows) - 100) < 0.2
    assert all(row["us"] > 0 for row in rows)
