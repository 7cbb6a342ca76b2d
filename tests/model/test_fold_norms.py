"""CausalLM.fold_norm_weights: each layer's norm weights move into the projections after them."""

import dataclasses

import torch

from cleave.model.llama import CausalLM
from tests.graphs.test_runner import tiny_config


def test_folding_scales_every_column_once_and_leaves_unit_norms():
    # intermediate 2100: gate_up has 4200 rows, folded in two chunks of at most 4096
    torch.manual_seed(0)
    model = CausalLM(dataclasses.replace(tiny_config(), intermediate_size=2100, num_hidden_layers=1)).eval()
    layer = model.layers[0]
    with torch.no_grad():
        layer.input_layernorm.weight.normal_(1.0, 0.3)
        layer.post_attention_layernorm.weight.normal_(1.0, 0.3)
        model.norm.weight.normal_(1.0, 0.3)
    input_norm, post_norm = layer.input_layernorm.weight.clone(), layer.post_attention_layernorm.weight.clone()
    final_norm = model.norm.weight.clone()
    qkv, gate_up = layer.self_attn.qkv_proj.weight.clone(), layer.mlp.gate_up_proj.weight.clone()
    o_proj, down = layer.self_attn.o_proj.weight.clone(), layer.mlp.down_proj.weight.clone()

    assert model.fold_norm_weights() is model and model.norms_folded
    model.fold_norm_weights()  # a second call changes nothing

    torch.testing.assert_close(layer.self_attn.qkv_proj.weight, qkv * input_norm, rtol=0, atol=0)
    torch.testing.assert_close(layer.mlp.gate_up_proj.weight, gate_up * post_norm, rtol=0, atol=0)
    assert torch.equal(layer.input_layernorm.weight, torch.ones_like(input_norm))
    assert torch.equal(layer.post_attention_layernorm.weight, torch.ones_like(post_norm))
    # what no norm feeds is untouched, and so is the final norm (lm_head may be tied)
    assert torch.equal(layer.self_attn.o_proj.weight, o_proj) and torch.equal(layer.mlp.down_proj.weight, down)
    assert torch.equal(model.norm.weight, final_norm)
