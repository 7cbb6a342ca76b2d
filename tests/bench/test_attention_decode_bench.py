"""bench/attention_decode.py: its head shapes (the timing itself needs a GPU)."""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench" / "attention_decode.py"


@pytest.fixture(scope="module")
def bench():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("bench_attention_decode", BENCH)
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_attention_decode"] = module
    try:
        spec.loader.exec_module(module)  # type: ignore[union-attr]
        yield module
    finally:
        sys.modules.pop("bench_attention_decode", None)


def test_heads_parse_as_query_kv_and_head_dim(bench):
    assert bench.parse_heads("32:4:128") == (32, 4, 128)
    with pytest.raises(argparse.ArgumentTypeError, match="not a multiple"):
        bench.parse_heads("30:4:128")
