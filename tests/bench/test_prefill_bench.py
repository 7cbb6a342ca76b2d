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


def test_a_chunked_prompt_is_steps_each_after_the_cached_ones(bench):
    """`--chunk 4`: a 10-token prompt in steps of 4, 4 and 2 tokens over contexts of 4, 8 and 10,
    each writing its own slots; 0 is one step."""
    steps = bench.prefill_steps(10, 4, [3, 1, 2], 4, "cpu")
    assert [(start, end) for start, end, _ in steps] == [(0, 4), (4, 8), (8, 10)]
    assert [(m.max_query_len, m.seq_lens.tolist()) for _, _, m in steps] == [(4, [4]), (4, [8]), (2, [10])]
    assert steps[1][2].slot_mapping.tolist() == [4, 5, 6, 7]  # block 1
    assert steps[2][2].slot_mapping.tolist() == [8, 9]  # block 2
    (whole,) = bench.prefill_steps(10, 0, [3, 1, 2], 4, "cpu")
    assert whole[:2] == (0, 10) and whole[2].slot_mapping.tolist() == [12, 13, 14, 15, 4, 5, 6, 7, 8, 9]
    assert bench.parse_args(["--out", "x.json", "--chunk", "2048"]).chunk == 2048
