"""Triton paged attention and KV write against their torch references.

CPU runs use the Triton interpreter (each launch costs ~0.5 s), so shapes stay tiny;
`@pytest.mark.gpu` tests repeat the comparison at serving shapes on the device.
"""

from __future__ import annotations

import pytest
import torch

from cleave.kernels.attention import (
    mixed_decode_splits,
    mixed_decode_variants,
    paged_attention,
    paged_attention_reference,
    write_kv,
    write_kv_reference,
)
from cleave.kernels.attention_decode import choose_num_splits, decode_num_warps, merge_block_s, paged_decode_attention
from cleave.kernels.attention_prefill import PrefillLaunch, paged_prefill_attention
from cleave.kv.metadata import PAD_SLOT_ID, AttentionMetadata

BLOCK_SIZE = 4
HEAD_DIM = 16
SCALE = HEAD_DIM**-0.5


def random_cache(num_blocks: int, num_kv_heads: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    cache = torch.randn(2, num_blocks, BLOCK_SIZE, num_kv_heads, HEAD_DIM, generator=generator)
    return cache.to(dtype)  # [2, num_blocks, block_size, Hkv, D]


def random_query(num_tokens: int, num_q_heads: int, dtype: torch.dtype, seed: int = 1) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(num_tokens, num_q_heads, HEAD_DIM, generator=generator).to(dtype)


def tolerance(dtype: torch.dtype) -> dict[str, float]:
    return {"atol": 2e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 3e-2, "rtol": 3e-2}


def test_write_kv_scatters_and_skips_padding_slots():
    cache = torch.zeros(2, 6, BLOCK_SIZE, 2, HEAD_DIM)
    key = torch.randn(4, 2, HEAD_DIM)
    value = torch.randn(4, 2, HEAD_DIM)
    slots = torch.tensor([5, PAD_SLOT_ID, 17, 8], dtype=torch.int64)
    expected = cache.clone()
    write_kv_reference(key, value, expected, slots)

    write_kv(key, value, cache, slots, impl="triton")

    assert torch.equal(cache, expected)
    flat = cache.view(2, -1, 2, HEAD_DIM)
    written = {5, 17, 8}
    untouched = [slot for slot in range(flat.shape[1]) if slot not in written]
    assert torch.count_nonzero(flat[:, untouched]) == 0
    assert torch.equal(flat[0, 17], key[2]) and torch.equal(flat[1, 8], value[3])


def test_write_kv_casts_to_bf16_cache():
    cache = torch.zeros(2, 3, BLOCK_SIZE, 1, HEAD_DIM, dtype=torch.bfloat16)
    key = torch.randn(2, 1, HEAD_DIM)
    value = torch.randn(2, 1, HEAD_DIM)
    slots = torch.tensor([1, 9], dtype=torch.int64)
    expected = cache.clone()
    write_kv_reference(key, value, expected, slots)

    write_kv(key, value, cache, slots, impl="triton")

    # The interpreter truncates fp32 -> bf16 where torch rounds: one bf16 ulp apart at most.
    torch.testing.assert_close(cache.float(), expected.float(), atol=0, rtol=2**-7)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_without_cached_prefix(dtype):
    cache = random_cache(num_blocks=6, num_kv_heads=1, dtype=dtype)
    metadata = AttentionMetadata.build([7], [7], [[4, 1]], BLOCK_SIZE)
    query = random_query(7, 1, dtype)

    out = paged_attention(query, cache, metadata, SCALE, impl="triton")

    expected = paged_attention_reference(query, cache, metadata, SCALE)
    torch.testing.assert_close(out.float(), expected.float(), **tolerance(dtype))


def test_prefill_mixed_batch_with_prefix_gqa_and_noncontiguous_tables():
    # Sequence 0: 3 new tokens after a 6-token cached prefix; 1: a decode token;
    # 2: a 5-token prompt with no prefix. Blocks are scattered and out of order.
    cache = random_cache(num_blocks=12, num_kv_heads=2, dtype=torch.float32)
    metadata = AttentionMetadata.build(
        [3, 1, 5], [9, 6, 5], [[7, 2, 10], [9, 3], [11, 5]], BLOCK_SIZE, max_blocks_per_seq=4
    )
    query = random_query(9, 4, torch.float32)

    out = paged_attention(query, cache, metadata, SCALE, impl="triton")

    expected = paged_attention_reference(query, cache, metadata, SCALE)
    torch.testing.assert_close(out, expected, **tolerance(torch.float32))


PREFILL_OPTIONS = [
    dict(pack_gqa=True), dict(heavy_first=True), dict(causal_split=True),
    dict(pack_gqa=True, heavy_first=True, causal_split=True),
]


def test_layers_start_with_the_prefill_launch_tuned_for_their_head_size():
    from cleave.kernels.attention_prefill import DEFAULT_PREFILL_LAUNCH, TUNED_PREFILL_LAUNCHES, prefill_launch_for

    assert prefill_launch_for(64) == prefill_launch_for(16) == TUNED_PREFILL_LAUNCHES[64]
    assert prefill_launch_for(128) == prefill_launch_for(96) == TUNED_PREFILL_LAUNCHES[128]
    assert prefill_launch_for(256) == DEFAULT_PREFILL_LAUNCH  # no tuned launch holds heads this large
    # a lone fresh prompt goes to dense SDPA with grouped KV heads on every tuned launch
    assert all(launch.dense_fresh and launch.dense_gqa for launch in TUNED_PREFILL_LAUNCHES.values())


@pytest.mark.parametrize("options", PREFILL_OPTIONS, ids=lambda options: "+".join(options))
@pytest.mark.parametrize(("num_q_heads", "num_kv_heads"), [(4, 2), (6, 2), (2, 2)])
@pytest.mark.parametrize("window", [None, 7])
def test_prefill_launch_options_attend_as_the_reference(options, num_q_heads, num_kv_heads, window):
    """Packed GQA heads (2 and 3 a KV head, and 1), heavy blocks first and the unmasked walk
    below the diagonal: a prompt after a 19-token cached prefix over several query blocks,
    a prompt without one, and a decode token, with and without a window; sinks on 6 heads."""
    cache = random_cache(num_blocks=40, num_kv_heads=num_kv_heads, dtype=torch.float32)
    tables = [list(range(39, 28, -1)), list(range(1, 11)), [20, 12, 25]]
    metadata = AttentionMetadata.build([21, 37, 1], [40, 37, 9], tables, BLOCK_SIZE)
    query = random_query(59, num_q_heads, torch.float32)
    sinks = torch.linspace(-2.0, 2.0, num_q_heads) if num_q_heads == 6 else None

    out = paged_prefill_attention(query, cache, metadata, SCALE, block_m=16, block_n=8, sliding_window=window,
                                  sinks=sinks, **options)

    expected = paged_attention_reference(query, cache, metadata, SCALE, sliding_window=window, sinks=sinks)
    torch.testing.assert_close(out, expected, **tolerance(torch.float32))


MIXED_TABLES = [[30, 31, 32, 33, 34, 35], [36], list(range(1, 11)), list(range(50, 40, -1)), list(range(14, 20))]


def mixed_batch() -> AttentionMetadata:
    """Two decodes (21 and 1 tokens of context) lead a 1-token prompt chunk, 21 prompt tokens
    after a 19-token cached prefix and a 24-token prompt without one (48 tokens)."""
    return AttentionMetadata.build([1, 1, 1, 21, 24], [21, 1, 37, 40, 24], MIXED_TABLES, BLOCK_SIZE)


def test_metadata_counts_only_the_leading_single_token_sequences():
    assert mixed_batch().num_decode_seqs == 3
    assert AttentionMetadata.build([2, 1], [5, 6], [[1, 2], [3, 4]], BLOCK_SIZE).num_decode_seqs == 0
    decodes = mixed_batch().leading(2)
    assert (decodes.num_seqs, decodes.max_query_len, decodes.query_start_loc.tolist()) == (2, 1, [0, 1, 2])
    with pytest.raises(ValueError, match="leads with 3"):
        mixed_batch().leading(4)


def test_prefill_kernel_from_first_seq_leaves_the_rows_before_it():
    """`first_seq` starts the grid after the decodes: their rows of `out` stay as given."""
    cache = random_cache(num_blocks=52, num_kv_heads=2, dtype=torch.float32)
    metadata = mixed_batch()
    query = random_query(48, 4, torch.float32)
    out = torch.full_like(query, float("nan"))

    paged_prefill_attention(query, cache, metadata, SCALE, block_m=16, block_n=8, first_seq=3, out=out)

    expected = paged_attention_reference(query, cache, metadata, SCALE)
    assert out[:3].isnan().all()
    torch.testing.assert_close(out[3:], expected[3:], **tolerance(torch.float32))


@pytest.mark.parametrize(("num_q_heads", "window"), [(4, None), (6, 7)])
def test_mixed_batch_decodes_on_the_decode_kernel_attend_as_the_reference(monkeypatch, num_q_heads, window):
    """`PrefillLaunch(decode_rows=True)`: the leading decodes go to the split-KV decode kernel
    (called once, over exactly them) and the prompts to the prefill kernel; with a window,
    and sinks on 6 heads."""
    import cleave.kernels.attention as attention

    decode_batches = []

    def spy(query, kv_cache, metadata, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        decode_batches.append(metadata.num_seqs)
        return paged_decode_attention(query, kv_cache, metadata, *args, **kwargs)

    monkeypatch.setattr(attention, "paged_decode_attention", spy)
    cache = random_cache(num_blocks=52, num_kv_heads=2, dtype=torch.float32)
    metadata = mixed_batch()
    query = random_query(48, num_q_heads, torch.float32)
    sinks = torch.linspace(-2.0, 2.0, num_q_heads) if num_q_heads == 6 else None

    out = paged_attention(query, cache, metadata, SCALE, impl="triton", sliding_window=window, sinks=sinks,
                          prefill=PrefillLaunch(block_m=16, block_n=8, decode_rows=True))

    expected = paged_attention_reference(query, cache, metadata, SCALE, sliding_window=window, sinks=sinks)
    assert decode_batches == [3]
    torch.testing.assert_close(out, expected, **tolerance(torch.float32))


def test_prefill_query_blocks_split_a_long_prompt():
    cache = random_cache(num_blocks=12, num_kv_heads=1, dtype=torch.float32)
    metadata = AttentionMetadata.build([19, 2], [21, 30], [list(range(1, 7)), list(range(11, 3, -1))], BLOCK_SIZE)
    query = random_query(21, 2, torch.float32)

    out = paged_prefill_attention(query, cache, metadata, SCALE, block_m=16, block_n=16)

    expected = paged_attention_reference(query, cache, metadata, SCALE)
    torch.testing.assert_close(out, expected, **tolerance(torch.float32))


@pytest.mark.parametrize(
    ("dtype", "num_splits"), [(torch.float32, 4), (torch.bfloat16, 4), (torch.float32, 1), (torch.float32, 8), (torch.bfloat16, 16)]
)
def test_decode_with_several_splits_gqa(dtype, num_splits):
    cache = random_cache(num_blocks=20, num_kv_heads=2, dtype=dtype)
    # 16-token tiles over 4 splits: seq 0 (3 tiles) uses 3 splits, seq 1 one partial tile,
    # seq 2 exactly two; with one split (or one active: seq 1) the kernel normalises and writes
    # the output itself.
    metadata = AttentionMetadata.build(
        [1, 1, 1], [37, 5, 32], [list(range(19, 9, -1)), [3, 8], list(range(1, 9))], BLOCK_SIZE
    )
    query = random_query(3, 4, dtype)

    out = paged_decode_attention(query, cache, metadata, SCALE, num_splits=num_splits, block_n=16)

    expected = paged_attention_reference(query, cache, metadata, SCALE)
    torch.testing.assert_close(out.float(), expected.float(), **tolerance(dtype))


@pytest.mark.parametrize("num_warps", [2, 4])
def test_wide_heads_merge_their_splits_in_smaller_chunks(num_warps):
    """Eight query heads of 128 per KV head (Qwen3-30B-A3B's shape) merge 4 splits per chunk
    with two warps, 8 with four: 11 active splits of 16 take three chunks (two), the last one
    partly masked."""
    assert merge_block_s(8, 128, 16) == 4 and merge_block_s(4, 64, 32) == 16 and merge_block_s(8, 128, 2) == 2
    assert merge_block_s(8, 128, 16, num_warps=4) == 8 and merge_block_s(8, 128, 16, num_warps=8) == 16
    generator = torch.Generator().manual_seed(5)
    head_dim = 128
    cache = torch.randn(2, 44, BLOCK_SIZE, 1, head_dim, generator=generator)
    query = torch.randn(1, 8, head_dim, generator=generator)
    metadata = AttentionMetadata.build([1], [170], [list(range(43, 0, -1))], BLOCK_SIZE)  # 11 tiles of 16
    out = paged_decode_attention(query, cache, metadata, head_dim**-0.5, num_splits=16, block_n=16,
                                 num_warps=num_warps)
    expected = paged_attention_reference(query, cache, metadata, head_dim**-0.5)
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=1e-5)


def test_decode_warps_follow_the_heads_and_the_batch(monkeypatch):
    """The decode kernel's default warps (`decode_num_warps`): two for 64-wide heads, four for
    128-wide ones; a lone sequence's take eight, and four where 8 query heads of 64 share a
    KV head (gpt-oss-20b; Llama-3.2-1B's 4 keep two); with the answer of each."""
    from cleave.kernels import attention_decode

    assert [decode_num_warps(64, 8, 8), decode_num_warps(64, 1, 4), decode_num_warps(128, 2, 8),
            decode_num_warps(256, 64, 1)] == [2, 2, 4, 4]
    assert decode_num_warps(64, 1, 8) == 4
    assert decode_num_warps(128, 1, 8) == decode_num_warps(256, 1, 1) == 8
    launches: list[int] = []
    original = attention_decode._decode_launcher

    def recording(grid, args, constexprs, num_warps, **launch):  # type: ignore[no-untyped-def]
        launches.append(num_warps)
        return original(grid, args, constexprs, num_warps, **launch)

    monkeypatch.setattr(attention_decode, "_decode_launcher", recording)
    generator = torch.Generator().manual_seed(6)
    for head_dim in (64, 128):
        pages = -(-20 // BLOCK_SIZE)
        cache = torch.randn(2, pages + 1, BLOCK_SIZE, 1, head_dim, generator=generator)
        query = torch.randn(1, 8, head_dim, generator=generator)
        metadata = AttentionMetadata.build([1], [20], [list(range(pages, 0, -1))], BLOCK_SIZE)
        out = paged_decode_attention(query, cache, metadata, head_dim**-0.5, num_splits=2, block_n=16)
        torch.testing.assert_close(out, paged_attention_reference(query, cache, metadata, head_dim**-0.5),
                                   atol=2e-5, rtol=1e-5)
    assert launches == [4, 8]  # one sequence each, 8 query heads a KV head


def test_decode_capacity_grid_and_padding_rows_give_zeros():
    # As under a CUDA graph: max_seq_len is the capacity, the last row is padding
    # (seq_len 0, slot -1) reading nothing; splits past each real length exit early.
    cache = random_cache(num_blocks=10, num_kv_heads=1, dtype=torch.float32)
    metadata = AttentionMetadata.build([1, 1], [6, 13], [[2, 5, 0, 0], [9, 1, 4, 7]], BLOCK_SIZE)
    metadata.seq_lens = torch.tensor([6, 13, 0], dtype=torch.int32)
    metadata.query_start_loc = torch.arange(4, dtype=torch.int32)
    metadata.block_tables = torch.cat([metadata.block_tables, torch.zeros(1, 4, dtype=torch.int32)])
    metadata.max_seq_len = 64
    query = random_query(3, 2, torch.float32)

    out = paged_attention(query, cache, metadata, SCALE, impl="triton")

    expected = paged_attention_reference(query, cache, metadata, SCALE)
    torch.testing.assert_close(out, expected, **tolerance(torch.float32))
    assert torch.count_nonzero(out[2]) == 0


@pytest.mark.parametrize(
    ("num_seqs", "max_seq_len", "num_splits"),
    [(1, 1024, 16), (1, 131072, 128), (1, 100, 2), (32, 32768, 4), (64, 1024, 2), (256, 32768, 1), (512, 100, 1)],
)
def test_split_count_fills_the_gpu_from_the_batch_shape(num_seqs, max_seq_len, num_splits):
    # ~1024 programs over sequences x 8 KV heads, never more splits than 64-token tiles.
    assert choose_num_splits(num_seqs, 8, max_seq_len) == num_splits


def test_wide_heads_cap_the_splits_at_sixteen_merge_chunks():
    # Qwen3-30B-A3B: 4 KV heads of 8 x 128 query heads merge 4 partials a chunk, so at most 64
    # splits (not the 256 that would bring the grid to 1024 programs at batch 1)
    chunk = merge_block_s(8, 128, 256)
    assert chunk == 4
    assert choose_num_splits(1, 4, 40960, 64, chunk) == 64
    assert choose_num_splits(1, 8, 40960, 64, merge_block_s(4, 64, 256)) == 128  # Llama-3.2-1B: unchanged



def test_a_mixed_steps_decodes_split_by_their_count_alone_into_few_variants():
    # Llama-3.2-1B's heads: powers of four from the count (the split count is a constexpr,
    # so each value is a compiled variant); 256 decodes of any context take five variants
    splits = [mixed_decode_splits(count, 32, 8, 64) for count in (1, 2, 3, 4, 8, 16, 33, 64, 248)]
    assert splits == [64, 64, 64, 16, 16, 4, 4, 1, 1]
    assert mixed_decode_variants(256, 32, 8, 64) == [1, 2, 4, 16, 64]

@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gpu_prefill_and_decode_match_reference(dtype):
    device = torch.device("cuda")
    generator = torch.Generator(device="cpu").manual_seed(0)
    block_size, num_kv_heads, num_q_heads, head_dim = 16, 8, 32, 64
    num_blocks = 1200
    cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=generator).to(device, dtype)
    permutation = (torch.randperm(num_blocks - 1, generator=generator) + 1).tolist()
    seq_lens = [1, 700, 4099, 9000]
    tables, used = [], 0
    for seq_len in seq_lens:
        count = -(-seq_len // block_size)
        tables.append(permutation[used : used + count])
        used += count
    for query_lens in ([1, 300, 129, 1000], [1, 1, 1, 1]):
        metadata = AttentionMetadata.build(query_lens, seq_lens, tables, block_size, device=device)
        query = torch.randn(sum(query_lens), num_q_heads, head_dim, generator=generator).to(device, dtype)
        out = paged_attention(query, cache, metadata, head_dim**-0.5, impl="triton")
        expected = paged_attention_reference(query, cache, metadata, head_dim**-0.5)
        torch.testing.assert_close(out.float(), expected.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("options", PREFILL_OPTIONS, ids=lambda options: "+".join(options))
@pytest.mark.parametrize("heads", [(32, 8, 64), (32, 4, 128)], ids=["llama-1b", "qwen3-moe"])
def test_gpu_prefill_launch_options_match_reference(options, heads):
    """The prefill options at serving shapes in bf16, compiled for the device: a prompt after a
    cached prefix and a 2048-token prompt, with 128-row blocks."""
    device = torch.device("cuda")
    generator = torch.Generator(device="cpu").manual_seed(3)
    num_q_heads, num_kv_heads, head_dim = heads
    block_size = 16
    cache = torch.randn(2, 400, block_size, num_kv_heads, head_dim, generator=generator).to(device, torch.bfloat16)
    permutation = (torch.randperm(399, generator=generator) + 1).tolist()
    tables = [permutation[:200], permutation[200:328]]
    metadata = AttentionMetadata.build([1000, 2048], [3190, 2048], tables, block_size, device=device)
    query = torch.randn(3048, num_q_heads, head_dim, generator=generator).to(device, torch.bfloat16)
    out = paged_prefill_attention(query, cache, metadata, head_dim**-0.5, block_m=128, block_n=64, num_warps=8,
                                  **options)
    expected = paged_attention_reference(query, cache, metadata, head_dim**-0.5)
    torch.testing.assert_close(out.float(), expected.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("heads", [(32, 8, 64), (32, 4, 128)], ids=["llama-1b", "qwen3-moe"])
def test_gpu_mixed_batch_decodes_on_the_decode_kernel_match_reference(heads):
    """A mixed step as the engine builds it mid-ramp (64 decodes of 1-1.5k tokens of context
    ahead of two 512-token prompt chunks, one after a cached prefix), bf16, with its decodes
    on the decode kernel."""
    device = torch.device("cuda")
    generator = torch.Generator(device="cpu").manual_seed(4)
    num_q_heads, num_kv_heads, head_dim = heads
    block_size, num_decodes = 16, 64
    contexts = torch.randint(1, 1536, (num_decodes,), generator=generator).tolist()
    query_lens, seq_lens = [1] * num_decodes + [512, 512], contexts + [1024, 512]
    widths = [-(-seq_len // block_size) for seq_len in seq_lens]
    permutation = (torch.randperm(sum(widths), generator=generator) + 1).tolist()
    tables, start = [], 0
    for width in widths:
        tables.append(permutation[start:start + width])
        start += width
    cache = torch.randn(2, sum(widths) + 1, block_size, num_kv_heads, head_dim, generator=generator)
    cache = cache.to(device, torch.bfloat16)
    metadata = AttentionMetadata.build(query_lens, seq_lens, tables, block_size, device=device)
    query = torch.randn(sum(query_lens), num_q_heads, head_dim, generator=generator).to(device, torch.bfloat16)
    out = paged_attention(query, cache, metadata, head_dim**-0.5, prefill=PrefillLaunch(decode_rows=True))
    expected = paged_attention_reference(query, cache, metadata, head_dim**-0.5)
    torch.testing.assert_close(out.float(), expected.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
def test_gpu_write_kv_matches_reference():
    device = torch.device("cuda")
    cache = torch.zeros(2, 64, 16, 8, 128, dtype=torch.bfloat16, device=device)
    key = torch.randn(300, 8, 128, device=device, dtype=torch.bfloat16)
    value = torch.randn(300, 8, 128, device=device, dtype=torch.bfloat16)
    slots = torch.randperm(64 * 16, device=device)[:300]
    slots[::7] = PAD_SLOT_ID
    expected = cache.clone()
    write_kv_reference(key, value, expected, slots)

    write_kv(key, value, cache, slots, impl="triton")

    assert torch.equal(cache, expected)


def test_decode_split_counters_are_left_zeroed_for_the_next_launch():
    # As the CUDA-graph buffers do: one zeroed counter buffer reused by every layer and step;
    # the last split of each (sequence, KV head) merges and resets its counter. Row 2 is padding.
    cache = random_cache(num_blocks=20, num_kv_heads=2, dtype=torch.float32)
    metadata = AttentionMetadata.build([1, 1], [37, 9], [list(range(19, 9, -1)), [3, 8, 0]], BLOCK_SIZE)
    metadata.seq_lens = torch.tensor([37, 9, 0], dtype=torch.int32)
    metadata.query_start_loc = torch.arange(4, dtype=torch.int32)
    metadata.block_tables = torch.cat([metadata.block_tables, torch.zeros(1, metadata.block_tables.shape[1], dtype=torch.int32)])
    metadata.split_counters = torch.zeros(16, dtype=torch.int32)
    query = random_query(3, 4, torch.float32)
    expected = paged_attention_reference(query, cache, metadata, SCALE)

    for _ in range(2):
        out = paged_decode_attention(query, cache, metadata, SCALE, num_splits=4, block_n=16)
        torch.testing.assert_close(out, expected, **tolerance(torch.float32))
        assert torch.count_nonzero(metadata.split_counters) == 0
    assert torch.count_nonzero(out[2]) == 0


@pytest.mark.parametrize("window", [1, 5, 16, 40])
def test_sliding_window_prefill_and_decode(window):
    # Prefill: seq 0 has a 9-token cached prefix, seq 1 none; decode: three sequences over
    # 4 splits, so windows shorter and longer than a split and than the context are covered.
    cache = random_cache(num_blocks=24, num_kv_heads=2, dtype=torch.float32)
    prefill = AttentionMetadata.build([12, 7], [21, 7], [[5, 9, 2, 11, 20, 6], [3, 8]], BLOCK_SIZE)
    query = random_query(19, 4, torch.float32)
    out = paged_prefill_attention(query, cache, prefill, SCALE, block_m=16, block_n=16, sliding_window=window)
    expected = paged_attention_reference(query, cache, prefill, SCALE, sliding_window=window)
    torch.testing.assert_close(out, expected, **tolerance(torch.float32))

    tables = [list(range(19, 9, -1)), [3, 8], list(range(1, 9))]
    decode = AttentionMetadata.build([1, 1, 1], [37, 5, 32], tables, BLOCK_SIZE)
    query = random_query(3, 4, torch.float32)
    out = paged_decode_attention(query, cache, decode, SCALE, num_splits=4, block_n=16, sliding_window=window)
    expected = paged_attention_reference(query, cache, decode, SCALE, sliding_window=window)
    torch.testing.assert_close(out, expected, **tolerance(torch.float32))
    if window < 32:  # the window changes the answer: not the full-context attention
        full = paged_attention_reference(query, cache, decode, SCALE)
        assert not torch.allclose(out[0], full[0], atol=1e-3)


@pytest.mark.parametrize("window", [None, 5])
def test_attention_sinks_prefill_and_decode(window):
    """gpt-oss's per-head sink logits (one large, one tiny, two ordinary), with and without a
    window, in the prefill kernel and the decode kernel with one split and with four."""
    sinks = torch.tensor([3.0, -20.0, 0.5, -1.0])
    cache = random_cache(num_blocks=24, num_kv_heads=2, dtype=torch.float32)
    prefill = AttentionMetadata.build([12, 7], [21, 7], [[5, 9, 2, 11, 20, 6], [3, 8]], BLOCK_SIZE)
    query = random_query(19, 4, torch.float32)
    expected = paged_attention_reference(query, cache, prefill, SCALE, sliding_window=window, sinks=sinks)
    plain = paged_attention_reference(query, cache, prefill, SCALE, sliding_window=window)
    assert (expected[:, 0] - plain[:, 0]).abs().max() > 0.1  # a large sink takes weight
    torch.testing.assert_close(expected[:, 1], plain[:, 1], atol=1e-6, rtol=0)  # a tiny one none
    out = paged_prefill_attention(query, cache, prefill, SCALE, block_m=16, block_n=16, sliding_window=window,
                                  sinks=sinks)
    torch.testing.assert_close(out, expected, **tolerance(torch.float32))

    tables = [list(range(19, 9, -1)), [3, 8], list(range(1, 9))]
    decode = AttentionMetadata.build([1, 1, 1], [37, 5, 32], tables, BLOCK_SIZE)
    query = random_query(3, 4, torch.float32)
    expected = paged_attention_reference(query, cache, decode, SCALE, sliding_window=window, sinks=sinks)
    for num_splits in (1, 4):
        out = paged_decode_attention(query, cache, decode, SCALE, num_splits=num_splits, block_n=16,
                                     sliding_window=window, sinks=sinks)
        torch.testing.assert_close(out, expected, **tolerance(torch.float32))
    out = paged_attention(query, cache, decode, SCALE, impl="triton", sliding_window=window, sinks=sinks)
    torch.testing.assert_close(out, expected, **tolerance(torch.float32))
