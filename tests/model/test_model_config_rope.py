"""ModelConfig parsing (transformers 4 and 5 layouts) and rotary tables against transformers."""

from __future__ import annotations

import pytest
import torch
import transformers

from cleave.model.config import ModelConfig
from cleave.model.rope import build_cos_sin_cache, compute_inv_freq

BASE = {
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 1000,
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 2,
    "num_attention_heads": 8,
    "max_position_embeddings": 4096,
}
LLAMA3_SCALING = {
    "factor": 32.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


def test_transformers4_layout():
    config = ModelConfig.from_dict(
        {**BASE, "rope_theta": 500000.0, "rope_scaling": {"type": "llama3", **LLAMA3_SCALING},
         "torch_dtype": "bfloat16", "eos_token_id": [128001, 128009], "num_key_value_heads": 2}
    )
    assert config.head_dim == 32 and config.num_key_value_heads == 2
    assert config.rope_theta == 500000.0
    assert config.rope_scaling == {"rope_type": "llama3", **LLAMA3_SCALING}
    assert config.dtype == torch.bfloat16
    assert config.eos_token_ids == (128001, 128009)
    assert (config.attention_bias, config.qk_norm, config.tie_word_embeddings) == (False, False, False)


def test_transformers5_layout_and_family_flags():
    config = ModelConfig.from_dict(
        {**BASE, "architectures": ["Qwen3ForCausalLM"], "head_dim": 64, "dtype": "float16",
         "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0}, "eos_token_id": 7,
         "tie_word_embeddings": True, "sliding_window": 4096, "use_sliding_window": False}
    )
    assert config.head_dim == 64 and config.num_key_value_heads == 8
    assert (config.rope_theta, config.rope_scaling) == (1000000.0, None)
    assert (config.qk_norm, config.attention_bias, config.tie_word_embeddings) == (True, False, True)
    assert config.dtype == torch.float16 and config.eos_token_ids == (7,)
    assert config.sliding_window is None
    assert ModelConfig.from_dict({**BASE, "architectures": ["Qwen2ForCausalLM"]}).attention_bias


def test_unsupported_configs_fail_clearly():
    with pytest.raises(ValueError, match=r"unsupported architecture 'PhiForCausalLM'; supported: LlamaForCausalLM"):
        ModelConfig.from_dict({**BASE, "architectures": ["PhiForCausalLM"]})
    with pytest.raises(ValueError, match="hidden_act='gelu'"):
        ModelConfig.from_dict({**BASE, "hidden_act": "gelu"})
    with pytest.raises(ValueError, match="unsupported rope_type 'longrope'"):
        compute_inv_freq(64, 10000.0, {"rope_type": "longrope", "factor": 4.0})


@pytest.mark.parametrize(
    "rope_parameters",
    [
        {"rope_type": "default", "rope_theta": 10000.0},
        {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
        {"rope_type": "llama3", "rope_theta": 500000.0, **LLAMA3_SCALING},
        {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
         "truncate": False, "original_max_position_embeddings": 4096},  # gpt-oss's
        {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 4096},
    ],
    ids=["default", "linear", "llama3", "yarn-gpt-oss", "yarn-truncated"],
)
def test_cos_sin_cache_matches_transformers_bit_for_bit(rope_parameters):
    hf_config = transformers.LlamaConfig(
        hidden_size=512, num_attention_heads=4, max_position_embeddings=16384, rope_parameters=rope_parameters
    )
    config = ModelConfig.from_dict({**hf_config.to_dict(), "architectures": ["LlamaForCausalLM"]})
    rotary = transformers.models.llama.modeling_llama.LlamaRotaryEmbedding(hf_config)

    inv_freq = compute_inv_freq(config.head_dim, config.rope_theta, config.rope_scaling)
    assert torch.equal(inv_freq, rotary.inv_freq)

    positions = torch.tensor([[0, 1, 17, 1000, 8191, 16383]])
    hf_cos, hf_sin = rotary(torch.zeros(1, dtype=torch.float32), positions)  # [1, P, D]
    cache = build_cos_sin_cache(config.head_dim, config.max_position_embeddings, config.rope_theta, config.rope_scaling)
    assert cache.shape == (16384, 128) and cache.dtype == torch.float32
    cos, sin = cache[positions[0]].chunk(2, dim=-1)  # [P, D/2] each; HF repeats them across both halves
    assert torch.equal(cos, hf_cos[0, :, :64]) and torch.equal(sin, hf_sin[0, :, :64])
