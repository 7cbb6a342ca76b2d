"""bench/prefill.py: its attention launches parse and reach every layer (timing needs a GPU)."""

from __future__ import annotations

import pytest

from tests.bench.bench_modules import bench_fixture

bench = bench_fixture("prefill")


def test_attention_launches_parse_as_json_and_are_set_on_every_layer(bench):
    from cleave.kernels.attention_prefill import PrefillLaunch
    from cleave.model.llama import CausalLM
    from tests.graphs.test_runner import tiny_config

    args = bench.parse_args(["--out", "x.json", "--attention-launches", '{"pack_gqa": true}', '{"block_m": 128}'])
    assert args.attention_launches == [{"pack_gqa": True}, {"block_m": 128}]
    assert bench.parse_args(["--out", "x.json"]).attention_launches == []
    with pytest.raises(SystemExit):
        bench.parse_args(["--out", "x.json", "--attention-launches", "{pack_gqa}"])
    model = CausalLM(tiny_config())
    bench.set_prefill_launch(model, PrefillLaunch(**args.attention_launches[0]))
    assert all(layer.self_attn.prefill_launch == PrefillLaunch(pack_gqa=True) for layer in model.layers)
