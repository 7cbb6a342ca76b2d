"""`TensorParallelLayout`: which heads, rows and checkpoint slices each rank holds (no processes)."""

from __future__ import annotations

import pytest
import torch

from cleave.model.config import ModelConfig
from cleave.parallel.group import TensorParallelGroup, tensor_parallel_group
from cleave.parallel.sharding import TensorParallelLayout


def make_config(**overrides) -> ModelConfig:
    fields = dict(
        architecture="LlamaForCausalLM", vocab_size=515, hidden_size=64, intermediate_size=96,
        num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4, head_dim=8,
    )
    return ModelConfig(**{**fields, **overrides})


def take(tensor: torch.Tensor, layout: TensorParallelLayout, hf_name: str) -> torch.Tensor:
    """This rank's part of `tensor` as the loader reads it (sliced, then zero-padded)."""
    part = layout.shard_of(hf_name)
    if part is None:
        return tensor
    piece = tensor.narrow(part.dim, part.start, part.end - part.start)
    padding = list(piece.shape)
    padding[part.dim] = part.num_padding
    return torch.cat((piece, piece.new_zeros(padding)), dim=part.dim)


@pytest.mark.parametrize("hf_name, shape", [
    ("model.layers.0.self_attn.q_proj.weight", (64, 64)),
    ("model.layers.1.self_attn.q_proj.bias", (64,)),
    ("model.layers.0.self_attn.k_proj.weight", (32, 64)),
    ("model.layers.0.self_attn.v_proj.bias", (32,)),
    ("model.layers.0.self_attn.o_proj.weight", (64, 64)),
    ("model.layers.0.mlp.gate_proj.weight", (96, 64)),
    ("model.layers.0.mlp.up_proj.weight", (96, 64)),
    ("model.layers.0.mlp.down_proj.weight", (64, 96)),
    ("model.embed_tokens.weight", (515, 64)),
    ("lm_head.weight", (515, 64)),
])
def test_the_ranks_shards_tile_each_split_tensor(hf_name: str, shape: tuple[int, ...]) -> None:
    config = make_config()
    full = torch.randn(shape)
    layouts = [TensorParallelLayout(config, rank, 2) for rank in range(2)]
    part = layouts[0].shard_of(hf_name)
    assert part is not None
    pieces = [take(full, layout, hf_name) for layout in layouts]
    assert pieces[0].shape == pieces[1].shape  # equal shards: the all-gather needs them
    joined = torch.cat(pieces, dim=part.dim).narrow(part.dim, 0, shape[part.dim])
    assert torch.equal(joined, full)


@pytest.mark.parametrize("hf_name", [
    "model.norm.weight", "model.layers.0.input_layernorm.weight", "model.layers.0.self_attn.q_norm.weight",
    "model.layers.0.self_attn.o_proj.bias",  # added once, after the sum over ranks
])
def test_norms_and_row_parallel_biases_are_whole_on_every_rank(hf_name: str) -> None:
    assert TensorParallelLayout(make_config(), 1, 2).shard_of(hf_name) is None


def test_vocabulary_shards_round_up_and_pad_the_last() -> None:
    first, last = (TensorParallelLayout(make_config(), rank, 2) for rank in range(2))
    assert (first.vocab_shard_size, first.vocab_start, first.vocab_end) == (258, 0, 258)
    assert (last.vocab_start, last.vocab_end) == (258, 515)
    assert last.shard_of("lm_head.weight").num_padding == 1 and first.shard_of("lm_head.weight").num_padding == 0


def test_kv_heads_split_when_there_are_enough() -> None:
    layouts = [TensorParallelLayout(make_config(), rank, 2) for rank in range(2)]
    assert [(lay.num_heads, lay.num_kv_heads, lay.first_head, lay.first_kv_head) for lay in layouts] == [
        (4, 2, 0, 0), (4, 2, 4, 2)
    ]
    config = layouts[1].rank_config()
    assert (config.num_attention_heads, config.num_key_value_heads, config.intermediate_size) == (4, 2, 48)
    assert config.vocab_size == 515 and config.hidden_size == 64  # logits are gathered whole


def test_a_kv_head_is_replicated_on_the_ranks_whose_queries_read_it() -> None:
    # 8 query heads over 2 KV heads (4 queries each) on 4 ranks of 2 query heads
    config = make_config(num_key_value_heads=2)
    layouts = [TensorParallelLayout(config, rank, 4) for rank in range(4)]
    assert [lay.num_kv_heads for lay in layouts] == [1, 1, 1, 1]
    assert [lay.first_kv_head for lay in layouts] == [0, 0, 1, 1]
    for lay in layouts:  # every query head of the rank maps to the KV head it holds
        queries = range(lay.first_head, lay.first_head + lay.num_heads)
        assert {head // 4 for head in queries} == {lay.first_kv_head}
    part = layouts[3].shard_of("model.layers.0.self_attn.k_proj.weight")
    assert (part.start, part.end) == (8, 16)  # KV head 1 of D=8


@pytest.mark.parametrize("overrides, size, message", [
    (dict(num_attention_heads=6, num_key_value_heads=6), 4, "num_attention_heads \\(6\\) is not divisible"),
    (dict(intermediate_size=90), 4, "intermediate_size \\(90\\) is not divisible"),
    (dict(num_attention_heads=6, num_key_value_heads=3), 2, "num_key_value_heads \\(3\\) and tensor_parallel_size \\(2\\)"),
])
def test_models_the_split_does_not_cover_are_refused(overrides: dict, size: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        TensorParallelLayout(make_config(**overrides), 0, size)


def test_one_rank_needs_no_group_and_more_need_torch_distributed() -> None:
    assert tensor_parallel_group(1) is None
    with pytest.raises(RuntimeError, match="torchrun --nproc-per-node 2"):
        tensor_parallel_group(2)
    with pytest.raises(ValueError, match="outside a tensor-parallel group"):
        TensorParallelGroup(rank=2, world_size=2)
