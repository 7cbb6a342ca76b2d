"""bench/prefill.py: its attention launches parse (timing needs a GPU; `common.set_prefill_launch`
sets them: tests/bench/test_common.py)."""

from __future__ import annotations

import pytest

from tests.bench.bench_modules import bench_fixture

bench = bench_fixture("prefill")


def test_attention_launches_parse_as_json(bench):
    args = bench.parse_args(["--out", "x.json", "--attention-launches", '{"pack_gqa": true}', '{"block_m": 128}'])
    assert args.attention_launches == [{"pack_gqa": True}, {"block_m": 128}]
    assert bench.parse_args(["--out", "x.json"]).attention_launches == []
    with pytest.raises(SystemExit):
        bench.parse_args(["--out", "x.json", "--attention-launches", "{pack_gqa}"])
