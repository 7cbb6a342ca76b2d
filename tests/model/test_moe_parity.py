"""Qwen3-MoE and gpt-oss against transformers on tiny random checkpoints (CPU, fp32), on the
torch references and on the Triton kernels (interpreter)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from cleave.model.config import ModelConfig
from cleave.model.llama import DecoderLayer
from cleave.model.loader import load_model
from cleave.model.moe import SparseMoeBlock
from cleave.model.tokenizer import Tokenizer
from cleave.testing.tiny_models import GPT_OSS_SWIGLU_LIMIT, MOE_ARCHITECTURES, write_tiny_checkpoint
from tests.model.test_llama_parity import TOLERANCE, greedy_generate, prompt_ids, run_chunks


@pytest.fixture(scope="module")
def moe_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny-moe")
    paths = {arch: write_tiny_checkpoint(root / arch, arch, seed=20 + i) for i, arch in enumerate(MOE_ARCHITECTURES)}
    paths["qwen3-moe-unnormalised"] = write_tiny_checkpoint(
        root / "qwen3-moe-unnormalised", "qwen3-moe", seed=30, norm_topk_prob=False, decoder_sparse_step=2,
        mlp_only_layers=[],
    )
    return paths


@pytest.fixture(scope="module")
def moe_hf_models(moe_checkpoints: dict[str, Path]) -> dict[str, torch.nn.Module]:
    import transformers

    return {
        name: transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        for name, path in moe_checkpoints.items()
    }


def test_configs_name_their_sparse_layers_windows_and_extras(moe_checkpoints):
    qwen = ModelConfig.from_pretrained(moe_checkpoints["qwen3-moe"])
    assert qwen.moe_layers == (0, 2) and qwen.num_experts == 8 and qwen.num_experts_per_tok == 2
    assert qwen.qk_norm and qwen.norm_topk_prob and not qwen.attention_sinks
    unnormalised = ModelConfig.from_pretrained(moe_checkpoints["qwen3-moe-unnormalised"])
    assert unnormalised.moe_layers == (1,) and not unnormalised.norm_topk_prob  # decoder_sparse_step 2
    oss = ModelConfig.from_pretrained(moe_checkpoints["gpt-oss"])
    assert oss.moe_layers == (0, 1) and oss.attention_sinks and oss.o_proj_bias and oss.expert_bias
    assert (oss.layer_sliding_window(0), oss.layer_sliding_window(1)) == (6, None)
    assert oss.swiglu_limit == GPT_OSS_SWIGLU_LIMIT and oss.rope_scaling["rope_type"] == "yarn"
    raw = json.loads((moe_checkpoints["gpt-oss"] / "config.json").read_text())
    del raw["layer_types"]  # as transformers fills it in: sliding first, then alternating
    assert ModelConfig.from_dict(raw).layer_types == ("sliding_attention", "full_attention")

    model = load_model(moe_checkpoints["qwen3-moe"], impl="torch")
    kinds = [type(layer.mlp) for layer in model.layers]
    assert kinds[0] is SparseMoeBlock and kinds[2] is SparseMoeBlock and kinds[1] is not SparseMoeBlock
    assert isinstance(model.layers[0], DecoderLayer)
    assert not model.fold_norm_weights().norms_folded  # no fused decode layouts for MoE


def test_unsupported_quantization_is_refused(moe_checkpoints, tmp_path):
    raw = json.loads((moe_checkpoints["qwen3-moe"] / "config.json").read_text())
    raw["quantization_config"] = {"quant_method": "mxfp4"}
    with pytest.raises(ValueError, match="Qwen3MoeForCausalLM with quantization_config quant_method='mxfp4'"):
        ModelConfig.from_dict(raw)
    raw = json.loads((moe_checkpoints["gpt-oss"] / "config.json").read_text())
    raw["quantization_config"] = {"quant_method": "gptq", "bits": 4}
    with pytest.raises(ValueError, match=r"quant_method='gptq' is not supported \(supported: mxfp4\)"):
        ModelConfig.from_dict(raw)


@pytest.mark.parametrize("name", [*MOE_ARCHITECTURES, "qwen3-moe-unnormalised"])
@torch.no_grad()
def test_prefill_chunks_and_decode_steps_match_transformers(name, moe_checkpoints, moe_hf_models):
    model = load_model(moe_checkpoints[name], impl="torch")
    input_ids = prompt_ids(model.config.vocab_size)  # 64 tokens, well past gpt-oss's 6-token window
    expected = moe_hf_models[name](input_ids[None]).logits[0].float()
    assert (run_chunks(model, input_ids, [64]) - expected).abs().max().item() <= TOLERANCE
    assert (run_chunks(model, input_ids, [40, 21, 1, 1, 1]) - expected).abs().max().item() <= TOLERANCE


@pytest.mark.parametrize("name", MOE_ARCHITECTURES)
@torch.no_grad()
def test_greedy_continuation_matches_generate(name, moe_checkpoints, moe_hf_models):
    path = moe_checkpoints[name]
    model = load_model(path, impl="torch")
    prompt = prompt_ids(model.config.vocab_size).tolist()
    ours = greedy_generate(model, prompt, 32, Tokenizer.from_pretrained(path).eos_token_ids)
    hf_out = moe_hf_models[name].generate(
        torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        max_new_tokens=32, do_sample=False,
    )
    assert ours == hf_out[0, len(prompt):].tolist()


@pytest.mark.parametrize("name", MOE_ARCHITECTURES)
@torch.no_grad()
def test_triton_kernels_match_transformers(name, moe_checkpoints, moe_hf_models):
    """Every op on its Triton kernel (the fused MoE, attention with sinks and windows): a
    prefill, a chunk over a cached prefix, single-token decode steps and a two-token step."""
    model = load_model(moe_checkpoints[name], impl="triton")
    input_ids = prompt_ids(model.config.vocab_size, 24)
    expected = moe_hf_models[name](input_ids[None]).logits[0].float()
    assert (run_chunks(model, input_ids, [12, 7, 1, 1, 1, 2]) - expected).abs().max().item() <= TOLERANCE


@torch.no_grad()
@pytest.mark.parametrize("name", ["qwen3-moe", "gpt-oss"])
def test_moe_decode_steps_on_the_gemv_layout_match_transformers(name, moe_checkpoints, moe_hf_models, monkeypatch):
    """Single-token steps run the GEMV decode layout (norms inside the router and expert GEMVs,
    the routing between them, the residual add in the down GEMV; gpt-oss's
    qkv, o and router biases in the GEMVs' epilogues, its sinks and window in the attention);
    12- and 7-token chunks there take the norm, the fused layer and an add."""
    from cleave.model import fused_decode

    fused_layers = []
    real_moe_gemv = fused_decode.moe_gemv

    def counting(*args, **kwargs):  # type: ignore[no-untyped-def]
        fused_layers.append(kwargs["add_to"] is not None and kwargs["norm_weight"] is not None
                            and args[3] is not None)  # routed weights
        return real_moe_gemv(*args, **kwargs)

    monkeypatch.setattr(fused_decode, "moe_gemv", counting)
    model = load_model(moe_checkpoints[name], impl="triton")
    assert fused_decode.gemv_layout_applies(model, torch.zeros(1, model.config.hidden_size))
    input_ids = prompt_ids(model.config.vocab_size, 24)
    expected = moe_hf_models[name](input_ids[None]).logits[0].float()
    assert (run_chunks(model, input_ids, [12, 7, 1, 1, 1, 2]) - expected).abs().max().item() <= TOLERANCE
    sparse_layers = sum(isinstance(layer.mlp, SparseMoeBlock) for layer in model.layers)
    assert fused_layers == [True] * (4 * sparse_layers)  # the 1, 1, 1 and 2-token steps; not 12 or 7


@torch.no_grad()
@pytest.mark.parametrize("name", ["qwen3-moe", "gpt-oss"])
def test_routing_inside_the_first_expert_gemv_matches_transformers(name, moe_checkpoints, moe_hf_models, monkeypatch):
    """`route_in_gemv`: the GEMV decode layout's single-token steps route in the first expert
    GEMV (no routed weights passed in, the router logits instead), to the same logits."""
    from cleave.model import fused_decode

    routed_inside = []
    real_moe_gemv = fused_decode.moe_gemv

    def counting(*args, **kwargs):  # type: ignore[no-untyped-def]
        routed_inside.append(args[3] is None and kwargs["router_logits"] is not None)
        return real_moe_gemv(*args, **kwargs)

    monkeypatch.setattr(fused_decode, "moe_gemv", counting)
    model = load_model(moe_checkpoints[name], impl="triton")
    for module in model.modules():
        if isinstance(module, SparseMoeBlock):
            module.route_in_gemv = True
    input_ids = prompt_ids(model.config.vocab_size, 24)
    expected = moe_hf_models[name](input_ids[None]).logits[0].float()
    assert (run_chunks(model, input_ids, [21, 1, 1, 1]) - expected).abs().max().item() <= TOLERANCE
    sparse_layers = sum(isinstance(layer.mlp, SparseMoeBlock) for layer in model.layers)
    assert routed_inside == [True] * (3 * sparse_layers)


@torch.no_grad()
@pytest.mark.parametrize("name", ["qwen3-moe", "gpt-oss"])
def test_routing_in_the_router_gemv_matches_transformers(name, moe_checkpoints, moe_hf_models, monkeypatch):
    """`route_in_router`: the GEMV decode layout's single-token steps route in the router
    GEMV's last program (no routing launch), to the same logits; steps of more tokens route
    as before."""
    from cleave.model import fused_decode

    calls = []
    real_router_route = fused_decode.router_route

    def counting(*args, **kwargs):  # type: ignore[no-untyped-def]
        calls.append(args[0].shape[0])
        return real_router_route(*args, **kwargs)

    monkeypatch.setattr(fused_decode, "router_route", counting)
    model = load_model(moe_checkpoints[name], impl="triton")
    for module in model.modules():
        if isinstance(module, SparseMoeBlock):
            module.route_in_router = True
    input_ids = prompt_ids(model.config.vocab_size, 24)
    expected = moe_hf_models[name](input_ids[None]).logits[0].float()
    assert (run_chunks(model, input_ids, [20, 2, 1, 1]) - expected).abs().max().item() <= TOLERANCE
    sparse_layers = sum(isinstance(layer.mlp, SparseMoeBlock) for layer in model.layers)
    assert calls == [1] * (2 * sparse_layers)


@torch.no_grad()
def test_gpt_oss_sinks_window_and_clamp_each_change_the_logits(moe_checkpoints, moe_hf_models):
    """The checkpoint exercises what sets gpt-oss apart: removing any of them moves the logits."""
    path = moe_checkpoints["gpt-oss"]
    input_ids = prompt_ids(moe_hf_models["gpt-oss"].config.vocab_size, 24)
    expected = moe_hf_models["gpt-oss"](input_ids[None]).logits[0].float()
    model = load_model(path, impl="torch")
    for layer in model.layers:
        layer.self_attn.sinks.fill_(-1e4)
    assert (run_chunks(model, input_ids, [24]) - expected).abs().max().item() > 100 * TOLERANCE
    model = load_model(path, impl="torch")
    model.layers[0].self_attn.sliding_window = None
    assert (run_chunks(model, input_ids, [24]) - expected).abs().max().item() > 100 * TOLERANCE
    model = load_model(path, impl="torch")
    for layer in model.layers:
        layer.mlp.activation = type(layer.mlp.activation)("swiglu_clamped", alpha=1.702, limit=1e9)
    assert (run_chunks(model, input_ids, [24]) - expected).abs().max().item() > 100 * TOLERANCE
