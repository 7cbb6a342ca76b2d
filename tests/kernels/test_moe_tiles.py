"""The grouped MoE GEMMs' tiles: the built-in rule, tuned tables on disk, and the kernels run
with tiles other than the default ones (interpreter, tiny shapes)."""

from __future__ import annotations

import json

import pytest
import torch

from cleave.kernels.fused_moe import fused_experts, route
from cleave.kernels.moe_reference import fused_experts_reference
from cleave.kernels.moe_tiles import (
    GemmTiles,
    MoELaunch,
    default_launch,
    fits,
    load_table,
    moe_launch,
    nearest_launch,
    tuned_file_name,
)
from tests.kernels.test_fused_moe import EXPERTS, HIDDEN, _assert_close, _ragged_logits, _weights

SMALL = MoELaunch(16, GemmTiles(16, 16, 2, 2), GemmTiles(16, 16, 2, 2))
LARGE = MoELaunch(128, GemmTiles(128, 64, 8, 4), GemmTiles(256, 64, 8, 3))


@pytest.mark.parametrize(("num_entries", "block_m"), [(8, 16), (128 * 16, 16), (128 * 17, 32), (128 * 49, 64)])
def test_default_block_m_follows_the_entries_per_expert(num_entries, block_m):
    launch = default_launch(num_entries, 128, 768, 2048)
    assert launch.block_m == block_m
    assert launch.gate_up.num_warps == launch.down.num_warps == (4 if block_m == 16 else 8)
    assert (launch.gate_up.block_n, launch.gate_up.block_k) == (64, 64)


def test_tiles_refuse_sizes_the_kernel_cannot_take():
    with pytest.raises(ValueError, match="block_n must be a power of two"):
        GemmTiles(48, 64, 4)
    with pytest.raises(ValueError, match="block_k must be a power of two"):
        GemmTiles(64, 8, 4)
    with pytest.raises(ValueError, match="num_warps"):
        GemmTiles(64, 64, 3)
    with pytest.raises(ValueError, match="num_stages"):
        GemmTiles(64, 64, 4, 0)
    with pytest.raises(ValueError, match="block_m"):
        MoELaunch(24, GemmTiles(64, 64, 4), GemmTiles(64, 64, 4))


def test_fits_counts_both_halves_of_a_gated_tile():
    assert fits(128, GemmTiles(128, 64, 8, 4), gated=True)  # 48 KiB a stage, 128 accumulators a thread
    assert not fits(128, GemmTiles(128, 128, 8, 3), gated=True)  # 96 KiB a stage x 3
    assert not fits(128, GemmTiles(128, 64, 4, 2), gated=True)  # 256 accumulators a thread
    assert fits(128, GemmTiles(256, 64, 8, 3), gated=False)


def _write_table(path, launches: dict) -> None:
    path.write_text(json.dumps({"device": "test", "launches": launches}))


def test_a_tuned_table_gives_the_launch_nearest_the_token_count(tmp_path):
    path = tmp_path / "table.json"
    _write_table(path, {"16": SMALL.to_json(), "4096": LARGE.to_json()})
    table = load_table(path)
    assert table == {16: SMALL, 4096: LARGE}
    assert nearest_launch(table, 1) == nearest_launch(table, 2000) == SMALL
    assert nearest_launch(table, 2100) == nearest_launch(table, 65536) == LARGE
    assert MoELaunch.from_json(json.loads(json.dumps(LARGE.to_json()))) == LARGE


def test_a_missing_table_is_none_and_a_broken_one_an_error_naming_it(tmp_path):
    assert load_table(tmp_path / "absent.json") is None
    broken = tmp_path / "broken.json"
    _write_table(broken, {"16": {"block_m": 16, "gate_up": {"block_n": 48, "block_k": 64, "num_warps": 4}}})
    with pytest.raises(ValueError, match="broken.json is malformed"):
        load_table(broken)
    empty = tmp_path / "empty.json"
    _write_table(empty, {})
    with pytest.raises(ValueError, match="empty.json has no launches"):
        load_table(empty)


def test_table_names_carry_shape_dtype_and_device():
    name = tuned_file_name(128, 768, 2048, torch.bfloat16, "NVIDIA H200")
    assert name == "E=128,I=768,H=2048,dtype=bfloat16,device=NVIDIA_H200.json"


def test_cpu_tensors_take_the_built_in_rule(tmp_path):
    _write_table(tmp_path / tuned_file_name(EXPERTS, 64, HIDDEN, torch.float32, "cpu"), {"1": LARGE.to_json()})
    launch = moe_launch(3, 2, EXPERTS, 64, HIDDEN, torch.zeros(1), tuned_dir=tmp_path)
    assert launch == default_launch(6, EXPERTS, 64, HIDDEN)


@pytest.mark.parametrize("launch", [SMALL, MoELaunch(32, GemmTiles(32, 32, 4, 2), GemmTiles(64, 16, 4, 4))])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_gemms_with_given_tiles_match_reference(launch, dtype):
    # 40 tokens x top-2 over 8 experts, most to experts 0-2: groups longer than one block,
    # partial blocks, and an expert with none; N and K tiles narrower than the features
    w13, w2, _, _ = _weights(dtype, seed=5)
    hidden = (torch.randn(40, HIDDEN, generator=torch.Generator().manual_seed(6)) * 0.5).to(dtype)
    weights, ids = route(_ragged_logits(40, seed=7), 2, impl="torch")
    out = fused_experts(hidden, w13, w2, weights, ids, impl="triton", kernel="grouped", launch=launch)
    _assert_close(out, fused_experts_reference(hidden, w13, w2, weights, ids))
