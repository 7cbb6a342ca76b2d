"""`cleave.model.projection.project`: which projections may take the register GEMV."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from cleave.model import projection


class SummingLinear(nn.Linear):
    """A projection whose forward does more than the product (as a row-parallel one does)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * 2


@pytest.fixture
def gemv_calls(monkeypatch):  # type: ignore[no-untyped-def]
    """Every GEMV `project` would launch, with the CUDA check lifted (the weights stay on CPU)."""
    calls = []

    def fake_gemv(x, weight, bias=None, pdl=True):  # type: ignore[no-untyped-def]
        calls.append(weight)
        return x @ weight.t() + (0 if bias is None else bias)

    monkeypatch.setattr(projection, "small_linear", fake_gemv)
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    monkeypatch.setattr(projection, "use_triton", lambda x, impl: True)
    return calls


def test_a_plain_single_row_projection_takes_the_gemv_with_its_bias(gemv_calls):
    x = torch.randn(1, 8)
    linear = nn.Linear(8, 4, bias=False)
    torch.testing.assert_close(projection.project(linear, x), linear(x))
    biased = nn.Linear(8, 4, bias=True)  # gpt-oss's qkv, o and router
    torch.testing.assert_close(projection.project(biased, x), biased(x))
    assert gemv_calls == [linear.weight, biased.weight]


def test_multi_row_and_subclassed_projections_keep_their_forward(gemv_calls):
    x = torch.randn(1, 8)
    plain = nn.Linear(8, 4, bias=False)
    projection.project(plain, torch.randn(2, 8))  # two rows: cuBLAS
    summing = SummingLinear(8, 4, bias=False)
    torch.testing.assert_close(projection.project(summing, x), summing(x))  # its own forward ran
    assert gemv_calls == []
