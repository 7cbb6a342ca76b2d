"""bench/attention_decode.py: its head shapes (the timing itself needs a GPU)."""

from __future__ import annotations

import argparse

import pytest
import torch

from tests.bench.bench_modules import bench_fixture


bench = bench_fixture("attention_decode")


def test_heads_parse_as_query_kv_and_head_dim(bench):
    assert bench.parse_heads("32:4:128") == (32, 4, 128)
    with pytest.raises(argparse.ArgumentTypeError, match="not a multiple"):
        bench.parse_heads("30:4:128")


def test_grid_orders_parse_and_unknown_ones_are_refused(bench):
    assert bench.parse_orders("auto,on,off") == ["auto", "on", "off"]
    assert [bench.HEADS_FIRST[order] for order in ("auto", "on", "off")] == [None, True, False]
    with pytest.raises(argparse.ArgumentTypeError, match="auto, on or off, got sideways"):
        bench.parse_orders("on,sideways")


def test_fused_launches_write_each_sequences_newest_position(bench):
    """`--fused`: the NewKV of a decode step writes position context - 1 of each sequence into
    the slot its block table gives, with head norms only for head-norms."""
    import torch

    from cleave.kv.metadata import AttentionMetadata

    assert bench.parse_fused("none,rotary,head-norms") == ["none", "rotary", "head-norms"]
    with pytest.raises(argparse.ArgumentTypeError, match="got sideways"):
        bench.parse_fused("rotary,sideways")
    metadata = AttentionMetadata.build([1, 1], [40, 40], [[1, 2, 3], [4, 5, 6]], bench.BLOCK_SIZE,
                                       max_blocks_per_seq=4)
    query = torch.zeros(2, 8, 64)
    assert bench.new_kv_for("none", metadata, 40, query, 2, 64) is None
    rotary = bench.new_kv_for("rotary", metadata, 40, query, 2, 64)
    assert rotary.slot_mapping.tolist() == [3 * 16 + 7, 6 * 16 + 7] and rotary.positions.tolist() == [39, 39]
    assert rotary.head_norms is None and rotary.cos_sin_cache.shape == (64, 64)
    assert bench.new_kv_for("head-norms", metadata, 40, query, 2, 64).head_norms is not None


@pytest.mark.parametrize("layout", ["nhd", "hnd", "block-hnd"])
def test_each_cache_layout_is_a_view_the_kernel_takes(bench, layout):
    """`--layouts`: every layout is a [2, blocks, slots, KV heads, D] view with the head dim
    contiguous; hnd puts a head's slots of a block side by side, block-hnd a block's K and V too."""
    cache = bench.cache_in_layout(layout, num_blocks=3, kv_heads=2, head_dim=8, kv_dtype=torch.bfloat16,
                                  device=torch.device("cpu"))
    assert cache.shape == (2, 3, bench.BLOCK_SIZE, 2, 8)
    assert cache.stride(-1) == 1
    slot_stride, head_stride = cache.stride(2), cache.stride(3)
    if layout == "nhd":
        assert (slot_stride, head_stride) == (16, 8)
    else:
        assert (slot_stride, head_stride) == (8, 8 * bench.BLOCK_SIZE)
    assert (cache.stride(0) < cache.stride(1)) == (layout == "block-hnd")


def test_unknown_layouts_are_refused(bench):
    with pytest.raises(argparse.ArgumentTypeError, match="nhd, hnd or block-hnd, got hdn"):
        bench.parse_layouts("hnd,hdn")
