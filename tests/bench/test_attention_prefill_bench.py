"""bench/attention_prefill.py: its arguments and FLOP count (the timing itself needs a GPU)."""

from __future__ import annotations

import pytest
import torch

from tests.bench.bench_modules import bench_fixture


bench = bench_fixture("attention_prefill")


def test_defaults_are_the_engines_settings_and_flops_count_the_lower_triangle(bench):
    args = bench.parse_args([])
    # left out, the settings are the engine's for the head size
    assert (args.block_m, args.block_n, args.num_warps, args.num_stages) == ([128], [64], [8], [0])
    qwen = bench.parse_args(["--heads", "32:4:128"])
    assert (qwen.block_m, qwen.block_n, qwen.num_warps) == ([128], [64], [4])
    assert args.heads == (32, 8, 64) and args.tokens == [2048, 8192]
    sweep = bench.parse_args(["--tokens", "8192", "--block-m", "64", "128", "--num-stages", "2", "3"])
    assert sweep.block_m == [64, 128] and sweep.num_stages == [2, 3]
    # 8192 tokens, 32 heads of 64: 2 * 2 * 8192^2 / 2 * 32 * 64 = 275 GFLOP a layer
    assert bench.causal_flops(8192, 32, 64) == pytest.approx(2.749e11, rel=1e-3)


def test_launch_options_sweep_on_and_off(bench):
    args = bench.parse_args([])
    assert (args.pack_gqa, args.heavy_first, args.causal_split) == (["off"], ["on"], ["on"])  # the engine's
    sweep = bench.parse_args(["--pack-gqa", "off", "on", "--causal-split", "on"])
    assert [bench.SWITCHES[value] for value in sweep.pack_gqa] == [False, True] and sweep.causal_split == ["on"]
    with pytest.raises(SystemExit):
        bench.parse_args(["--heavy-first", "sometimes"])


def test_sdpa_rows_take_a_backend_and_unrepeated_kv_heads(bench):
    assert bench.parse_args([]).sdpa == ["auto"]
    query = torch.randn(24, 4, 8)
    outputs = {}
    for variant in ("auto", "math", "auto+gqa", "math+gqa"):
        torch.manual_seed(0)  # the same random key and value for every variant
        outputs[variant] = bench.sdpa_call(query, 2, variant)()
    for variant in ("math", "auto+gqa", "math+gqa"):
        torch.testing.assert_close(outputs[variant], outputs["auto"])
