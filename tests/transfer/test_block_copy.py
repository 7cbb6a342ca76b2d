"""Fused block copy kernel (under TRITON_INTERPRET on CPU, compiled where CUDA exists) against
its torch reference."""

from __future__ import annotations

import pytest
import torch

from cleave.errors import InvalidArgument
from cleave.transfer.block_copy import copy_blocks, copy_blocks_reference


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float8_e4m3fn])
def test_kernel_matches_reference(dtype):
    src = torch.randn(3, 2, 6, 2, 2, 4).to(dtype)
    src_ids, dst_ids = torch.tensor([4, 0, 5]), torch.tensor([1, 7, 2])
    expected = torch.zeros(3, 2, 8, 2, 2, 4, dtype=dtype)
    copy_blocks_reference(src, expected, src_ids, dst_ids, range(1, 3))
    # conftest turns the Triton interpreter on only on machines without CUDA
    device = "cuda" if torch.cuda.is_available() else "cpu"
    got = torch.zeros_like(expected, device=device)
    copy_blocks(src.to(device), got, src_ids.to(device), dst_ids.to(device), range(1, 3), use_kernel=True)
    got, expected, src = got.cpu().view(torch.uint8), expected.view(torch.uint8), src.view(torch.uint8)  # bits
    assert torch.equal(got, expected)
    assert torch.count_nonzero(got[0]) == 0  # layer 0 outside the range
    assert torch.equal(got[1:, :, [1, 7, 2]], src[1:, :, [4, 0, 5]])


def test_rejects_mismatched_caches():
    src = torch.zeros(2, 2, 4, 2, 2, 4)
    with pytest.raises(InvalidArgument, match="caches differ"):
        copy_blocks(src, torch.zeros(2, 2, 4, 2, 2, 8), torch.tensor([0]), torch.tensor([0]))
    with pytest.raises(InvalidArgument, match="equal length"):
        copy_blocks(src, src.clone(), torch.tensor([0, 1]), torch.tensor([0]))
