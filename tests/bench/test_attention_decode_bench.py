"""bench/attention_decode.py: its head shapes (the timing itself needs a GPU)."""

from __future__ import annotations

import argparse

import pytest

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
