"""Loading one rank's shard (no collective runs while loading, so one process can load every
rank's shard in turn): each split weight is the whole model's rows or columns of that rank."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from cleave.model.loader import CheckpointError, load_model
from cleave.parallel.group import TensorParallelGroup
from cleave.testing.tiny_models import write_tiny_checkpoint


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # 4 query heads, 2 KV heads, head_dim 16, intermediate 128, vocab 515 (not even)
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tp-load") / "llama", "llama", seed=41, vocab_size=515)


def test_each_rank_holds_its_rows_and_columns_of_the_whole_model(checkpoint: Path) -> None:
    whole = dict(load_model(checkpoint).named_parameters())
    q_rows, kv_rows, inter = 2 * 16, 16, 64  # per rank: 2 query heads, 1 KV head, half of 128
    q, k, v = whole["layers.1.self_attn.qkv_proj.weight"].split([64, 32, 32])
    gate, up = whole["layers.1.mlp.gate_up_proj.weight"].split([128, 128])
    for rank in range(2):
        shard = dict(load_model(checkpoint, tensor_parallel=TensorParallelGroup(rank, 2)).named_parameters())
        rows = slice(rank * q_rows, (rank + 1) * q_rows)
        kv = slice(rank * kv_rows, (rank + 1) * kv_rows)
        cols = slice(rank * inter, (rank + 1) * inter)
        assert torch.equal(shard["layers.1.self_attn.qkv_proj.weight"], torch.cat((q[rows], k[kv], v[kv])))
        assert torch.equal(shard["layers.1.self_attn.o_proj.weight"], whole["layers.1.self_attn.o_proj.weight"][:, rows])
        assert torch.equal(shard["layers.1.mlp.gate_up_proj.weight"], torch.cat((gate[cols], up[cols])))
        assert torch.equal(shard["layers.1.mlp.down_proj.weight"], whole["layers.1.mlp.down_proj.weight"][:, cols])
        assert torch.equal(shard["layers.1.input_layernorm.weight"], whole["layers.1.input_layernorm.weight"])
        # 258 vocabulary rows each: rank 1 has the last 257 and one zero row
        vocab = whole["lm_head.weight"][rank * 258 : (rank + 1) * 258]
        padded = torch.cat((vocab, vocab.new_zeros(258 - len(vocab), 64)))
        assert torch.equal(shard["lm_head.weight"], padded)
        assert torch.equal(shard["embed_tokens.weight"][: len(vocab)], whole["embed_tokens.weight"][rank * 258 :][:258])


def test_a_tensor_that_does_not_fit_the_split_is_named(checkpoint: Path, tmp_path: Path) -> None:
    broken = tmp_path / "broken"
    broken.mkdir()
    for file in checkpoint.iterdir():
        (broken / file.name).write_bytes(file.read_bytes())
    config = json.loads((broken / "config.json").read_text())
    (broken / "config.json").write_text(json.dumps({**config, "intermediate_size": 64}))
    with pytest.raises(CheckpointError, match=r"model\.layers\.0\.mlp\.(gate|up|down)_proj\.weight.*64 along dim"):
        load_model(broken, tensor_parallel=TensorParallelGroup(0, 2))
