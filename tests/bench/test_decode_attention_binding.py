"""bench/decode_attention_binding.py: a decode step's attention takes the bound setting on each
path the model reaches the kernel by, and a setting nothing took fails."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from cleave.kv.metadata import AttentionMetadata
from cleave.model.llama import CausalLM, allocate_kv_cache
from tests.bench.bench_modules import bench_fixture
from tests.graphs.test_runner import tiny_config

binding = bench_fixture("decode_attention_binding")
BLOCK_SIZE = 16


@torch.no_grad()
@pytest.mark.parametrize("qk_norm", [False, True], ids=["gemv-layout", "attend"])
def test_each_decode_path_takes_the_setting(binding, monkeypatch, qk_norm):
    """A single-token step of a model without q/k norms reaches the kernel through
    `cleave.kernels.attention`, one with them (Qwen3) through `Attention.attend`: both see the
    bound keywords, and leave the binding undone."""
    from cleave.kernels import attention_decode

    from cleave.kernels import attention, rotary_attention
    from cleave.model import fused_decode

    seen = []
    original = attention_decode.paged_decode_attention

    def recording(*args, **kwargs):  # type: ignore[no-untyped-def]
        seen.append(kwargs.get("num_splits"))
        return original(*args, **kwargs)

    monkeypatch.setattr(attention_decode, "paged_decode_attention", recording)
    callers = (attention, rotary_attention, fused_decode)
    before = [module.paged_decode_attention for module in callers]
    config = dataclasses.replace(tiny_config(), num_hidden_layers=1, qk_norm=qk_norm)
    model = CausalLM(config, impl="triton").eval()
    kv_cache = allocate_kv_cache(config, 2, BLOCK_SIZE)
    metadata = AttentionMetadata.build([1], [5], [[1]], BLOCK_SIZE)
    with binding.decode_attention_bound({"num_splits": 2}) as calls:
        model(torch.tensor([7]), torch.tensor([4]), kv_cache, metadata)
    binding.require_calls(calls, {"num_splits": 2})
    assert calls == [1] and seen == [2]
    assert [module.paged_decode_attention for module in callers] == before  # each module's own, restored


def test_a_setting_no_call_took_fails(binding):
    with binding.decode_attention_bound({"num_warps": 4}) as calls:
        pass
    with pytest.raises(RuntimeError, match="no decode attention call took"):
        binding.require_calls(calls, {"num_warps": 4})
