"""kv_groups: which models pair their window layers with their full-attention layers."""

from cleave.kv.groups import kv_groups, uniform_sliding_window
from cleave.model.config import ModelConfig


def _config(num_layers=4, **kwargs) -> ModelConfig:
    shape = dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=num_layers,
                 num_attention_heads=2, num_key_value_heads=1, head_dim=8)
    return ModelConfig(**shape, **kwargs)


def test_gpt_oss_pairs_each_sliding_layer_with_a_full_one():
    config = _config(architecture="GptOssForCausalLM", sliding_window=128,
                     layer_types=("sliding_attention", "full_attention") * 2)
    groups = kv_groups(config)
    assert groups.is_paired and groups.num_slots == 2 and groups.sliding_window == 128
    assert list(groups.layers()) == [(0, True), (0, False), (1, True), (1, False)]
    # a slot's KV is complete once both its layers ran
    assert [groups.slots_done_after(n) for n in range(5)] == [0, 0, 1, 1, 2]
    unpaired = kv_groups(config, pair_window_layers=False)
    assert not unpaired.is_paired and unpaired.num_slots == 4 and unpaired.sliding_window is None
    assert uniform_sliding_window(config) is None


def test_models_without_a_pair_for_every_layer_keep_a_slot_per_layer():
    llama = kv_groups(_config(architecture="LlamaForCausalLM"))
    assert llama.layer_slots == (0, 1, 2, 3) and not llama.is_paired and llama.sliding_window is None
    assert [llama.slots_done_after(n) for n in range(5)] == [0, 1, 2, 3, 4]
    mistral = kv_groups(_config(architecture="MistralForCausalLM", sliding_window=4096))
    assert not mistral.is_paired and mistral.sliding_window == 4096  # every layer drops: one table
    uneven = kv_groups(_config(num_layers=3, architecture="GptOssForCausalLM", sliding_window=128,
                               layer_types=("sliding_attention", "full_attention", "full_attention")))
    assert not uneven.is_paired and uneven.num_slots == 3 and uneven.sliding_window is None
