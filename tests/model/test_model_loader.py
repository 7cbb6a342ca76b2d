"""Loading safetensors checkpoints: sharding, dtype, tying, and errors that name the culprit."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from cleave.model.loader import CheckpointError, load_model
from cleave.testing.tiny_models import write_tiny_checkpoint


def copy_checkpoint(source: Path, destination: Path) -> Path:
    shutil.copytree(source, destination)
    return destination


def rewrite_weights(path: Path, edit) -> None:
    tensors = load_file(path / "model.safetensors")
    edit(tensors)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})


def test_sharded_checkpoint_loads_the_same_weights(tmp_path, tiny_checkpoints):
    sharded = write_tiny_checkpoint(tmp_path / "sharded", "qwen2", seed=1, max_shard_size="100KB")
    assert (sharded / "model.safetensors.index.json").is_file()
    assert len(list(sharded.glob("model-*.safetensors"))) > 1

    single, multi = load_model(tiny_checkpoints["qwen2"]), load_model(sharded)
    single_state, multi_state = single.state_dict(), multi.state_dict()
    assert single_state.keys() == multi_state.keys()
    for name, tensor in single_state.items():
        assert torch.equal(tensor, multi_state[name]), name


def test_fused_projections_hold_the_hf_tensors_in_order(tiny_checkpoints):
    path = tiny_checkpoints["qwen2"]
    hf = load_file(path / "model.safetensors")
    model = load_model(path)
    layer = model.layers[1]
    q, k, v = (hf[f"model.layers.1.self_attn.{x}_proj.weight"] for x in "qkv")
    assert torch.equal(layer.self_attn.qkv_proj.weight, torch.cat([q, k, v]))
    q_bias, k_bias, v_bias = (hf[f"model.layers.1.self_attn.{x}_proj.bias"] for x in "qkv")
    assert torch.equal(layer.self_attn.qkv_proj.bias, torch.cat([q_bias, k_bias, v_bias]))
    gate, up = hf["model.layers.1.mlp.gate_proj.weight"], hf["model.layers.1.mlp.up_proj.weight"]
    assert torch.equal(layer.mlp.gate_up_proj.weight, torch.cat([gate, up]))


def test_bf16_load_keeps_rope_table_float32_and_head_tied(tiny_checkpoints):
    path = tiny_checkpoints["llama-tied"]
    assert "lm_head.weight" not in load_file(path / "model.safetensors")
    model = load_model(path, dtype=torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.lm_head.weight is model.embed_tokens.weight
    assert model.cos_sin_cache.dtype == torch.float32
    reference = load_model(path).cos_sin_cache
    assert torch.equal(model.cos_sin_cache, reference)
    assert torch.equal(model.embed_tokens.weight, load_model(path).embed_tokens.weight.to(torch.bfloat16))


def test_missing_directory_and_weights_files(tmp_path, tiny_checkpoints):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_model(tmp_path / "nowhere")
    path = copy_checkpoint(tiny_checkpoints["llama"], tmp_path / "no-weights")
    (path / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="no model.safetensors or model.safetensors.index.json"):
        load_model(path)


def test_missing_shard_named_in_index(tmp_path):
    path = write_tiny_checkpoint(tmp_path / "sharded", "llama", max_shard_size="100KB")
    shard = sorted(path.glob("model-*.safetensors"))[-1]
    shard.unlink()
    with pytest.raises(FileNotFoundError, match=shard.name):
        load_model(path)


def test_missing_tensor_is_named(tmp_path, tiny_checkpoints):
    path = copy_checkpoint(tiny_checkpoints["mistral"], tmp_path / "missing")
    rewrite_weights(path, lambda t: t.pop("model.layers.1.self_attn.k_proj.weight"))
    with pytest.raises(CheckpointError, match=r"lacks 1 tensor\(s\).*model\.layers\.1\.self_attn\.k_proj\.weight"):
        load_model(path)


def test_untied_checkpoint_without_lm_head_fails(tmp_path, tiny_checkpoints):
    path = copy_checkpoint(tiny_checkpoints["llama"], tmp_path / "headless")
    rewrite_weights(path, lambda t: t.pop("lm_head.weight"))
    with pytest.raises(CheckpointError, match="lm_head.weight"):
        load_model(path)


def test_wrong_shape_names_file_tensor_and_shapes(tmp_path, tiny_checkpoints):
    path = copy_checkpoint(tiny_checkpoints["qwen3"], tmp_path / "misshapen")

    def shrink(tensors):
        tensors["model.layers.0.self_attn.q_norm.weight"] = torch.ones(8)

    rewrite_weights(path, shrink)
    with pytest.raises(
        CheckpointError,
        match=r"model\.safetensors: tensor 'model\.layers\.0\.self_attn\.q_norm\.weight' has shape \(8,\), "
        r"the model expects \(16,\)",
    ):
        load_model(path)


def test_unexpected_tensor_is_named(tmp_path, tiny_checkpoints):
    path = copy_checkpoint(tiny_checkpoints["llama"], tmp_path / "extra")

    def add_extra(tensors):
        tensors["model.layers.0.self_attn.q_norm.weight"] = torch.ones(16)

    rewrite_weights(path, add_extra)
    with pytest.raises(CheckpointError, match=r"unexpected tensor 'model\.layers\.0\.self_attn\.q_norm\.weight'"):
        load_model(path)


def test_unknown_architecture_lists_supported_ones(tmp_path, tiny_checkpoints):
    path = copy_checkpoint(tiny_checkpoints["llama"], tmp_path / "gpt2")
    config = json.loads((path / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"unsupported architecture 'GPT2LMHeadModel'; supported: .*LlamaForCausalLM"):
        load_model(path)


def test_another_families_config_is_refused_by_its_architecture_and_a_missing_field_by_its_name():
    from cleave.model.config import ModelConfig

    gpt2 = {"architectures": ["GPT2LMHeadModel"], "n_layer": 1, "n_embd": 32, "n_head": 2, "vocab_size": 100}
    with pytest.raises(ValueError, match=r"^unsupported architecture 'GPT2LMHeadModel'; supported: "):
        ModelConfig.from_dict(gpt2)  # not a KeyError on the first Llama field it lacks
    with pytest.raises(ValueError, match=r"^config.json of a LlamaForCausalLM has no 'num_hidden_layers'$"):
        ModelConfig.from_dict({"architectures": ["LlamaForCausalLM"], "vocab_size": 100, "num_attention_heads": 2})


def test_in_memory_state_dict_matches_files(tiny_checkpoints, hf_models):
    from cleave.model.loader import empty_model, load_hf_state_dict

    expected = load_model(tiny_checkpoints["qwen3"])
    model = load_hf_state_dict(empty_model(expected.config), hf_models["qwen3"].state_dict())
    for name, tensor in expected.state_dict().items():
        assert torch.equal(tensor, model.state_dict()[name]), name
    incomplete = dict(hf_models["qwen3"].state_dict())
    incomplete.pop("model.norm.weight")
    with pytest.raises(CheckpointError, match=r"state_dict lacks 1 tensor\(s\) the model needs: model\.norm\.weight"):
        load_hf_state_dict(empty_model(expected.config), incomplete)
