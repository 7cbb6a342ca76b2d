"""bench/moe_tune.py: candidates, and a dry run at tiny shapes on the CPU that writes a table
the MoE layer then loads."""

from __future__ import annotations

import json


from cleave.kernels.moe_tiles import MoELaunch, fits, load_table
from tests.bench.bench_modules import bench_fixture


bench = bench_fixture("moe_tune")


def test_defaults_cover_decode_batches_to_prefill(bench):
    args = bench.parse_args([])
    assert args.tokens == [16, 64, 256, 512, 1024, 2048, 4096, 8192] and args.model == "qwen3-30b-a3b"
    assert args.block_m == [16, 32, 64, 128] and args.stages == [2, 3, 4]


def test_candidates_fit_and_take_warps_from_the_tile(bench):
    args = bench.parse_args([])
    gate_up = bench.candidate_tiles(128, True, args)
    down = bench.candidate_tiles(128, False, args)
    assert gate_up and down
    assert all(fits(128, tiles, True) and tiles.block_n <= 128 for tiles in gate_up)
    assert all(fits(128, tiles, False) for tiles in down)
    assert all(tiles.num_warps == (8 if 128 * tiles.block_n * 2 > 8192 else 4) for tiles in gate_up)
    assert {tiles.num_warps for tiles in bench.candidate_tiles(16, False, args)} == {4}
    assert any(tiles.block_n == 256 for tiles in down)


def test_dry_run_writes_a_table_the_layer_loads(bench, tmp_path):
    rows = bench.main(["--dry-run", "--out", str(tmp_path / "results"), "--table-dir", str(tmp_path / "tables")])
    assert [row["tokens"] for row in rows] == [8]
    assert rows[0]["rejected"] == 0 and rows[0]["candidates"] == 4 and rows[0]["tuned_us"] > 0
    (table_path,) = (tmp_path / "tables").iterdir()
    assert table_path.name == "E=8,I=32,H=64,dtype=float32,device=cpu.json"
    table = load_table(table_path)
    assert set(table) == {8} and isinstance(table[8], MoELaunch) and table[8].block_m == 16
    payload = json.loads(table_path.read_text())
    assert payload["command"].startswith("python bench/moe_tune.py --dry-run")
    assert payload["results"] in {f"bench/results/moe/{path.stem}.md" for path in (tmp_path / "results").glob("*.md")}


def test_dry_run_tunes_packed_mxfp4_experts_into_their_own_table(bench, tmp_path):
    rows = bench.main(["--dry-run", "--packed-experts", "--out", str(tmp_path / "results"),
                       "--table-dir", str(tmp_path / "tables")])
    assert rows[0]["rejected"] == 0 and rows[0]["candidates"] == 4
    (table_path,) = (tmp_path / "tables").iterdir()
    assert table_path.name == "E=8,I=32,H=64,dtype=float32,device=cpu,weights=mxfp4.json"
    assert load_table(table_path)[8].gate_up.block_k == 32
