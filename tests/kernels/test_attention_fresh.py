"""A lone prompt with nothing cached before it on torch's dense SDPA (`PrefillLaunch.dense_fresh`):
the paged reference's answer over keys gathered from the cache slots the step wrote, and only
for the batches it can take."""

from __future__ import annotations

import pytest
import torch

import cleave.kernels.attention as attention
from cleave.kernels.attention import paged_attention, paged_attention_reference
from cleave.kernels.attention_fresh import fresh_prompt_attention, lone_fresh_prompt
from cleave.kernels.attention_prefill import PrefillLaunch
from cleave.kv.metadata import AttentionMetadata
from tests.kernels.test_attention import BLOCK_SIZE, SCALE, random_cache, random_query, tolerance

# a 13-token prompt on scattered, out-of-order blocks (its last block part-filled)
TABLE = [[9, 2, 7, 4]]
FRESH = AttentionMetadata.build([13], [13], TABLE, BLOCK_SIZE)


@pytest.mark.parametrize(("num_q_heads", "num_kv_heads"), [(4, 2), (6, 3), (2, 2)])
def test_a_fresh_prompt_attends_as_the_paged_reference(num_q_heads, num_kv_heads):
    cache = random_cache(num_blocks=12, num_kv_heads=num_kv_heads, dtype=torch.float32)
    query = random_query(13, num_q_heads, torch.float32)
    assert lone_fresh_prompt(query, cache, FRESH, None, None)

    out = fresh_prompt_attention(query, cache, FRESH, SCALE)

    expected = paged_attention_reference(query, cache, FRESH, SCALE)
    torch.testing.assert_close(out, expected, **tolerance(torch.float32))


@pytest.mark.parametrize("backend", ["auto", "math"])
def test_kv_heads_left_for_sdpas_gqa_attend_as_repeated_ones(backend):
    cache = random_cache(num_blocks=12, num_kv_heads=2, dtype=torch.float32)
    query = random_query(13, 6, torch.float32)
    out = fresh_prompt_attention(query, cache, FRESH, SCALE, backend=backend, gqa=True)
    torch.testing.assert_close(out, paged_attention_reference(query, cache, FRESH, SCALE), **tolerance(torch.float32))
    with pytest.raises(ValueError, match="backend must be 'auto' or one of"):
        fresh_prompt_attention(query, cache, FRESH, SCALE, backend="fa3")


def test_only_a_lone_prompt_with_no_prefix_window_sinks_or_fp8_cache_qualifies():
    cache = random_cache(num_blocks=12, num_kv_heads=2, dtype=torch.float32)
    query = random_query(13, 4, torch.float32)
    with_prefix = AttentionMetadata.build([13], [16], TABLE, BLOCK_SIZE)
    two_prompts = AttentionMetadata.build([6, 7], [6, 7], [[9, 2], [7, 4]], BLOCK_SIZE)
    assert not lone_fresh_prompt(query, cache, with_prefix, None, None)
    assert not lone_fresh_prompt(query, cache, two_prompts, None, None)
    assert not lone_fresh_prompt(query[:12], cache, FRESH, None, None)  # not the batch's token count
    assert not lone_fresh_prompt(query, cache, FRESH, 8, None)
    assert not lone_fresh_prompt(query, cache, FRESH, None, torch.zeros(4))
    assert not lone_fresh_prompt(query, cache.to(torch.bfloat16), FRESH, None, None)


def test_paged_attention_sends_only_qualifying_batches_to_dense_attention(monkeypatch):
    """With `dense_fresh` the lone fresh prompt takes dense attention (the reference's answer);
    a prompt after a cached prefix stays on the paged kernel, as does every batch without it."""
    calls = []

    def spy(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        calls.append(args[2])
        return fresh_prompt_attention(*args, **kwargs)

    monkeypatch.setattr(attention, "fresh_prompt_attention", spy)
    cache = random_cache(num_blocks=12, num_kv_heads=2, dtype=torch.float32)
    query = random_query(13, 4, torch.float32)
    with_prefix = AttentionMetadata.build([9], [13], TABLE, BLOCK_SIZE)
    dense = PrefillLaunch(block_m=16, block_n=8, dense_fresh=True)

    out = paged_attention(query, cache, FRESH, SCALE, impl="triton", prefill=dense)
    torch.testing.assert_close(out, paged_attention_reference(query, cache, FRESH, SCALE), **tolerance(torch.float32))
    assert calls == [FRESH]
    out = paged_attention(query[:9], cache, with_prefix, SCALE, impl="triton", prefill=dense)
    torch.testing.assert_close(out, paged_attention_reference(query[:9], cache, with_prefix, SCALE),
                               **tolerance(torch.float32))
    paged_attention(query, cache, FRESH, SCALE, impl="triton", prefill=PrefillLaunch(block_m=16, block_n=8))
    assert calls == [FRESH]


@pytest.mark.gpu
@pytest.mark.parametrize("heads", [(32, 8, 64), (32, 4, 128)], ids=["llama-1b", "qwen3-moe"])
def test_gpu_fresh_prompt_matches_the_paged_kernel(heads):
    """bf16 at serving shapes, on the device's flash attention: a 3000-token fresh prompt on
    shuffled blocks, against the paged prefill kernel over the same cache."""
    device = torch.device("cuda")
    generator = torch.Generator(device="cpu").manual_seed(5)
    num_q_heads, num_kv_heads, head_dim = heads
    block_size, num_tokens = 16, 3000
    blocks = (torch.randperm(400, generator=generator)[: -(-num_tokens // block_size)] + 1).tolist()
    cache = torch.randn(2, 401, block_size, num_kv_heads, head_dim, generator=generator).to(device, torch.bfloat16)
    metadata = AttentionMetadata.build([num_tokens], [num_tokens], [blocks], block_size, device=device)
    query = torch.randn(num_tokens, num_q_heads, head_dim, generator=generator).to(device, torch.bfloat16)
    paged = paged_attention(query, cache, metadata, head_dim**-0.5)
    for launch in (PrefillLaunch(dense_fresh=True), PrefillLaunch(dense_fresh=True, dense_gqa=True)):
        dense = paged_attention(query, cache, metadata, head_dim**-0.5, prefill=launch)
        torch.testing.assert_close(dense.float(), paged.float(), atol=2e-2, rtol=2e-2)
