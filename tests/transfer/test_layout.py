"""KV layouts carry the cache's dtype, an fp8 one included, across the wire, and layouts of
other dtypes are refused before any byte moves (a decode worker never reads fp8 bytes as bf16)."""

from __future__ import annotations

import pytest
import torch

from cleave.errors import FailedPrecondition, InvalidArgument
from cleave.rpc.convert import kv_layout_from_proto, kv_layout_to_proto
from cleave.transfer.kvstore_client import gather_blocks, scatter_blocks
from cleave.transfer.layout import check_layout, head_slice, layout_of
from cleave.transfer.tensors import gather_layer, scatter_layer, torch_dtype

L, NB, BS, H, D = 2, 5, 4, 2, 8


def fp8_cache(seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(L, 2, NB, BS, H, D, generator=generator).to(torch.float8_e4m3fn)  # [L, 2, NB, BS, Hkv, D]


def test_an_fp8_layout_names_its_dtype_and_crosses_the_wire():
    layout = layout_of(fp8_cache(), "m", "ns")
    assert layout.dtype == "float8_e4m3fn" and torch_dtype(layout.dtype) == torch.float8_e4m3fn
    assert kv_layout_from_proto(kv_layout_to_proto(layout)) == layout
    check_layout(layout, fp8_cache(1))


def test_layouts_of_other_kv_dtypes_are_refused_naming_the_dtype_and_the_fix():
    fp8 = layout_of(fp8_cache(), "m", "ns")
    bf16 = layout_of(torch.zeros(L, 2, NB, BS, H, D, dtype=torch.bfloat16), "m", "ns")
    with pytest.raises(FailedPrecondition, match="--kv-cache-dtype") as refused:
        head_slice(bf16, fp8)  # a bf16 prefill worker's sender, an fp8 decode worker's blocks
    assert refused.value.field == "layout.dtype"
    with pytest.raises(FailedPrecondition, match="dtype"):
        check_layout(fp8, torch.zeros(L, 2, NB, BS, H, D, dtype=torch.bfloat16))


def test_fp8_blocks_gather_and_scatter_bit_for_bit_and_other_dtypes_are_refused():
    src, dst = fp8_cache(), torch.zeros(L, 2, NB, BS, H, D, dtype=torch.float8_e4m3fn)
    scatter_layer(dst, 1, torch.tensor([3, 0]), gather_layer(src, 1, torch.tensor([1, 4])))
    scatter_blocks(dst, [2], gather_blocks(src, [0]))  # the kvstore's per-block payloads
    bits, src_bits = dst.view(torch.uint8), src.view(torch.uint8)
    assert torch.equal(bits[1, :, [3, 0]], src_bits[1, :, [1, 4]])
    assert torch.equal(bits[:, :, 2], src_bits[:, :, 0])
    with pytest.raises(InvalidArgument, match="misread"):
        scatter_layer(dst, 0, torch.tensor([1]), torch.zeros(2, 1, BS, H, D, dtype=torch.uint8))
    with pytest.raises(InvalidArgument, match="misread"):
        scatter_blocks(dst, [1], torch.zeros(1, L, 2, BS, H, D, dtype=torch.int8))
