"""A batch's one prompt on torch's dense SDPA (`PrefillLaunch.dense_fresh` / `dense_prefix`): the
paged reference's answer over the context gathered through its block table, with or without a
cached prefix, alone or after the batch's single-token decodes, and only for the batches it can
take."""

from __future__ import annotations

import pytest
import torch

import cleave.kernels.attention as attention
import cleave.kernels.attention_fresh as attention_fresh
from cleave.kernels.attention import paged_attention, paged_attention_reference
from cleave.kernels.attention_fresh import DensePrompt, dense_prompt, dense_prompt_attention
from cleave.kernels.attention_prefill import PrefillLaunch
from cleave.kv.metadata import AttentionMetadata
from tests.kernels.test_attention import BLOCK_SIZE, SCALE, random_cache, random_query, tolerance

# a 13-token prompt on scattered, out-of-order blocks (its last block part-filled)
TABLE = [[9, 2, 7, 4]]
FRESH = AttentionMetadata.build([13], [13], TABLE, BLOCK_SIZE)
# its last 9 tokens after a cached prefix of 4
PREFIXED = AttentionMetadata.build([9], [13], TABLE, BLOCK_SIZE)
# two decodes (contexts of 5 and 20), then those 9 tokens
MIXED = AttentionMetadata.build([1, 1, 9], [5, 20, 13], [[3, 0], [5, 6, 1, 8, 10], *TABLE], BLOCK_SIZE)
BOTH = {"fresh": True, "prefix": True}


@pytest.fixture
def short_prefix_queries(monkeypatch):
    """Prompts after a cached prefix qualify from 4 queries (the tests' prompts are short)."""
    monkeypatch.setattr(attention_fresh, "DENSE_PREFIX_MIN_QUERIES", 4)


@pytest.mark.parametrize(("num_q_heads", "num_kv_heads"), [(4, 2), (6, 3), (2, 2)])
@pytest.mark.parametrize("case", ["fresh", "prefixed"])
def test_a_prompt_attends_as_the_paged_reference(case, num_q_heads, num_kv_heads, short_prefix_queries):
    """A prompt after a cached prefix is causal from the bottom right: query i of 9 sees keys
    0 .. 4 + i."""
    metadata = FRESH if case == "fresh" else PREFIXED
    cache = random_cache(num_blocks=12, num_kv_heads=num_kv_heads, dtype=torch.float32)
    query = random_query(metadata.max_query_len, num_q_heads, torch.float32)
    prompt = dense_prompt(query, cache, metadata, None, None, **BOTH)
    assert prompt == DensePrompt(0, metadata.max_query_len, 13)

    out = dense_prompt_attention(query, cache, metadata, prompt, SCALE)

    expected = paged_attention_reference(query, cache, metadata, SCALE)
    torch.testing.assert_close(out, expected, **tolerance(torch.float32))


@pytest.mark.parametrize("backend", ["auto", "math"])
@pytest.mark.parametrize("metadata", [FRESH, PREFIXED], ids=["fresh", "prefixed"])
def test_kv_heads_left_for_sdpas_gqa_attend_as_repeated_ones(metadata, backend, short_prefix_queries):
    cache = random_cache(num_blocks=12, num_kv_heads=2, dtype=torch.float32)
    query = random_query(metadata.max_query_len, 6, torch.float32)
    prompt = dense_prompt(query, cache, metadata, None, None, **BOTH)
    out = dense_prompt_attention(query, cache, metadata, prompt, SCALE, backend=backend, gqa=True)
    torch.testing.assert_close(out, paged_attention_reference(query, cache, metadata, SCALE),
                               **tolerance(torch.float32))
    with pytest.raises(ValueError, match="backend must be 'auto' or one of"):
        dense_prompt_attention(query, cache, metadata, prompt, SCALE, backend="fa3")


def test_only_one_unpadded_prompt_with_no_window_sinks_or_fp8_cache_qualifies(short_prefix_queries):
    cache = random_cache(num_blocks=12, num_kv_heads=2, dtype=torch.float32)
    query = random_query(13, 4, torch.float32)
    two_prompts = AttentionMetadata.build([6, 7], [6, 7], [[9, 2], [7, 4]], BLOCK_SIZE)
    assert dense_prompt(query, cache, FRESH, None, None) == DensePrompt(0, 13, 13)
    assert dense_prompt(query, cache, two_prompts, None, None) is None
    assert dense_prompt(query[:12], cache, FRESH, None, None) is None  # not the batch's token count
    assert dense_prompt(query, cache, FRESH, 8, None) is None
    assert dense_prompt(query, cache, FRESH, None, torch.zeros(4)) is None
    assert dense_prompt(query, cache.to(torch.bfloat16), FRESH, None, None) is None
    # a prefix only where asked for, and fresh prompts only where asked for
    assert dense_prompt(query[:9], cache, PREFIXED, None, None) is None
    assert dense_prompt(query[:9], cache, PREFIXED, None, None, prefix=True) == DensePrompt(0, 9, 13)
    assert dense_prompt(query, cache, FRESH, None, None, fresh=False, prefix=True) is None
    # the prompt after the decodes the caller attends itself, not with other decodes left
    assert dense_prompt(query[:11], cache, MIXED, None, None, 2, **BOTH) == DensePrompt(2, 9, 13)
    assert dense_prompt(query[:11], cache, MIXED, None, None, 1, **BOTH) is None
    assert dense_prompt(query[:11], cache, MIXED, None, None, 0, **BOTH) is None
    # without host lengths (the CUDA graphs' buffers) the context length is not known
    graph_like = AttentionMetadata(FRESH.slot_mapping, FRESH.query_start_loc, FRESH.seq_lens, FRESH.block_tables,
                                   13, 13)
    assert dense_prompt(query, cache, graph_like, None, None, **BOTH) is None


def test_a_short_query_block_after_a_prefix_stays_on_the_paged_kernel():
    """Gathering the context costs two reads of its K/V, which a few queries do not earn back."""
    cache = random_cache(num_blocks=12, num_kv_heads=2, dtype=torch.float32)
    query = random_query(9, 4, torch.float32)
    assert attention_fresh.DENSE_PREFIX_MIN_QUERIES > 9
    assert dense_prompt(query, cache, PREFIXED, None, None, **BOTH) is None


@pytest.mark.parametrize(("metadata", "first_rows"), [(FRESH, 0), (PREFIXED, 0), (MIXED, 2)],
                         ids=["fresh", "prefixed", "after-decodes"])
def test_paged_attention_sends_only_qualifying_batches_to_dense_attention(metadata, first_rows, monkeypatch,
                                                                          short_prefix_queries):
    """With `dense_fresh` and `dense_prefix` the batch's prompt takes dense attention (the
    reference's answer; leading decodes on the decode kernel); with only the one that does not
    fit, the paged kernel runs."""
    calls = []

    def spy(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        calls.append(args[3])
        return dense_prompt_attention(*args, **kwargs)

    monkeypatch.setattr(attention, "dense_prompt_attention", spy)
    cache = random_cache(num_blocks=12, num_kv_heads=2, dtype=torch.float32)
    query = random_query(first_rows + metadata.max_query_len, 4, torch.float32)
    expected = paged_attention_reference(query, cache, metadata, SCALE)
    fresh = metadata is FRESH

    out = paged_attention(query, cache, metadata, SCALE, impl="triton",
                          prefill=PrefillLaunch(block_m=16, block_n=8, dense_fresh=True, dense_prefix=True))
    torch.testing.assert_close(out, expected, **tolerance(torch.float32))
    assert calls == [DensePrompt(first_rows, metadata.max_query_len, 13)]
    out = paged_attention(query, cache, metadata, SCALE, impl="triton",
                          prefill=PrefillLaunch(block_m=16, block_n=8, dense_fresh=not fresh, dense_prefix=fresh))
    torch.testing.assert_close(out, expected, **tolerance(torch.float32))
    assert len(calls) == 1


@pytest.mark.gpu
@pytest.mark.parametrize("prefix", [0, 1500], ids=["fresh", "prefixed"])
@pytest.mark.parametrize("heads", [(32, 8, 64), (32, 4, 128)], ids=["llama-1b", "qwen3-moe"])
def test_gpu_dense_prompt_matches_the_paged_kernel(heads, prefix):
    """bf16 at serving shapes, on the device's flash attention: a 3000-token prompt (after a
    1500-token cached prefix, or not) on shuffled blocks, alone and after 3 decodes, against the
    paged prefill kernel over the same cache."""
    device = torch.device("cuda")
    generator = torch.Generator(device="cpu").manual_seed(5)
    num_q_heads, num_kv_heads, head_dim = heads
    block_size, num_tokens = 16, 3000
    seq_len = prefix + num_tokens
    blocks = (torch.randperm(700, generator=generator) + 1).tolist()
    prompt_blocks, decode_blocks = blocks[: -(-seq_len // block_size)], blocks[-30:]
    cache = torch.randn(2, 701, block_size, num_kv_heads, head_dim, generator=generator).to(device, torch.bfloat16)
    query = torch.randn(num_tokens + 3, num_q_heads, head_dim, generator=generator).to(device, torch.bfloat16)
    alone = AttentionMetadata.build([num_tokens], [seq_len], [prompt_blocks], block_size, device=device)
    mixed = AttentionMetadata.build([1, 1, 1, num_tokens], [40, 100, 160, seq_len],
                                    [decode_blocks[:10], decode_blocks[10:20], decode_blocks[20:], prompt_blocks],
                                    block_size, device=device)
    launches = (PrefillLaunch(dense_fresh=True, dense_prefix=True),
                PrefillLaunch(dense_fresh=True, dense_prefix=True, dense_gqa=True))
    for metadata, rows in ((alone, query[:num_tokens]), (mixed, query)):
        paged = paged_attention(rows, cache, metadata, head_dim**-0.5)
        for launch in launches:
            dense = paged_attention(rows, cache, metadata, head_dim**-0.5, prefill=launch)
            torch.testing.assert_close(dense.float(), paged.float(), atol=2e-2, rtol=2e-2)
