"""L2Prefetch: what it accepts, and that prefetching changes no kernel's result."""

from __future__ import annotations

import pytest
import torch

from cleave.kernels.activation import silu_and_mul
from cleave.kernels.l2_prefetch import L2Prefetch
from cleave.kernels.row_norm import DeferredRMSNorm


def test_regions_are_at_most_two_contiguous_tensors():
    weight = torch.zeros(8, 16)
    with pytest.raises(ValueError, match="at most two regions"):
        L2Prefetch((weight, weight, weight))
    with pytest.raises(ValueError, match="contiguous"):
        L2Prefetch((weight.t(),))


def test_launch_args_pad_to_two_regions_and_prefetch_nothing_off_the_gpu():
    weight, like = torch.zeros(8, 100, dtype=torch.bfloat16), torch.zeros(3)
    assert L2Prefetch((weight,)).launch_args(like) == (0, (like, like), (0, 0))
    if torch.cuda.is_available():
        gpu_weight, gpu_like = weight.cuda(), like.cuda()
        regions, tensors, lines = L2Prefetch((gpu_weight, gpu_weight[:1])).launch_args(gpu_like)
        assert regions == 2 and tensors[0] is gpu_weight and lines == (13, 2)  # 1600 and 200 bytes


@pytest.mark.gpu
def test_gpu_prefetching_swiglu_gives_the_same_bits():
    torch.manual_seed(0)
    x = torch.randn(64, 2 * 8192, dtype=torch.bfloat16, device="cuda")
    residual = torch.randn(64, 2048, dtype=torch.bfloat16, device="cuda")
    down = torch.randn(2048, 8192, dtype=torch.bfloat16, device="cuda")
    row_norm = DeferredRMSNorm(residual, 1e-5)
    plain = silu_and_mul(x, row_norm=row_norm)
    prefetching = silu_and_mul(x, row_norm=row_norm, l2_prefetch=L2Prefetch((down, down[:100])))
    assert torch.equal(plain, prefetching)
