"""An fp8 (float8 e4m3, scale 1.0) KV cache: every Triton kernel that writes it stores the
bits the torch reference stores, saturating at +-448 instead of making NaN, and the attention
kernels reading it match the reference's fp32 attention over the dequantised cache.

Activations are fp32 here: the interpreter truncates fp32 -> bf16 where torch rounds (see
test_attention.py), which would blur a bit-for-bit comparison of the fp8 bytes behind it.
"""

from __future__ import annotations

import torch

from cleave.kernels.attention import paged_attention, paged_attention_reference, write_kv, write_kv_reference
from cleave.kernels.attention_decode import NewKV, paged_decode_attention
from cleave.kernels.attention_prefill import PrefillLaunch
from cleave.kernels.gemv import RotaryKVWrite
from cleave.kernels.kv_cache_dtype import FP8_E4M3_MAX, resolve_kv_cache_dtype, to_cache_dtype
from cleave.kernels.rotary_kv_write import rotary_write_kv, rotary_write_kv_reference
from cleave.kernels.small_linear import small_linear
from cleave.kv.metadata import AttentionMetadata
from tests.kernels.test_rotary import make_cache, split_qkv

FP8 = torch.float8_e4m3fn
BLOCK_SIZE = 4
HEAD_DIM = 16
SCALE = HEAD_DIM**-0.5


def fp8_cache(num_blocks: int, num_kv_heads: int, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    values = torch.randn(2, num_blocks, BLOCK_SIZE, num_kv_heads, HEAD_DIM, generator=generator)
    return to_cache_dtype(values, FP8)  # [2, num_blocks, block_size, Hkv, D]


def assert_same_bits(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Equal bytes (torch has no float8 `equal` on the CPU), and no NaN among them."""
    assert actual.dtype == expected.dtype == FP8
    assert not torch.isnan(actual.float()).any()
    assert torch.equal(actual.view(torch.uint8), expected.view(torch.uint8))


def test_the_torch_cast_saturates_and_rounds_to_nearest_even():
    x = torch.tensor([448.0, 449.0, 1e4, -1e4, 124.0, 0.0013, -0.0, 2.0**-10])
    cast = to_cache_dtype(x, FP8)
    # 124 is the tie between 120 and 128: even mantissa up; 0.0013 the nearest subnormal 2^-9;
    # 2^-10 the tie between 0 and 2^-9: even, 0
    assert cast.float().tolist() == [448.0, 448.0, 448.0, -448.0, 128.0, 2.0**-9, -0.0, 0.0]
    assert torch.signbit(cast.float()).tolist() == [False, False, False, True, False, False, True, False]
    assert resolve_kv_cache_dtype("fp8", torch.bfloat16) == FP8
    assert resolve_kv_cache_dtype("auto", torch.bfloat16) == torch.bfloat16


def test_write_kv_stores_the_references_bits_saturating_past_448():
    cache = torch.zeros(2, 6, BLOCK_SIZE, 2, HEAD_DIM, dtype=FP8)
    generator = torch.Generator().manual_seed(0)
    key = 200 * torch.randn(4, 2, HEAD_DIM, generator=generator)  # many past +-448
    value = torch.randn(4, 2, HEAD_DIM, generator=generator)
    key[0, 0, :4] = torch.tensor([449.0, 1e5, -3e4, 124.0])  # saturated, and a tie rounding up a binade
    value[1, 1, :2] = torch.tensor([2.0**-10, 3 * 2.0**-10])  # subnormal ties: to 0 and to 2^-8
    slots = torch.tensor([5, -1, 17, 8], dtype=torch.int64)
    expected = cache.clone()
    write_kv_reference(key, value, expected, slots)

    write_kv(key, value, cache, slots, impl="triton")

    assert_same_bits(cache, expected)
    flat = cache.view(2, -1, 2, HEAD_DIM).float()
    assert flat[0, 5, 0, :4].tolist() == [448.0, 448.0, -448.0, 128.0]
    assert flat[0].abs().max() == FP8_E4M3_MAX


def test_rotary_write_kv_stores_the_references_bits():
    num_q, num_kv, tokens = 2, 2, 3
    generator = torch.Generator().manual_seed(1)
    qkv = 300 * torch.randn(tokens, (num_q + 2 * num_kv) * HEAD_DIM, generator=generator)
    positions = torch.tensor([3, 40, 7])
    cos_sin = make_cache(64, HEAD_DIM)
    slots = torch.tensor([5, -1, 13], dtype=torch.int64)
    caches = []
    for write in (lambda *args: rotary_write_kv(*args, impl="triton"), rotary_write_kv_reference):
        data = qkv.clone()
        q, k = split_qkv(data, num_q, num_kv, HEAD_DIM)
        v = data[:, (num_q + num_kv) * HEAD_DIM :].view(tokens, num_kv, HEAD_DIM)
        cache = torch.zeros(2, 6, BLOCK_SIZE, num_kv, HEAD_DIM, dtype=FP8)
        write(q, k, v, positions, cos_sin, cache, slots, True)
        caches.append(cache)

    assert_same_bits(*caches)
    assert caches[0].float().abs().max() == FP8_E4M3_MAX


def test_the_qkv_gemv_epilogue_caches_its_k_and_v_as_the_torch_cast_does():
    num_q, num_kv, head_dim, rows = 2, 1, 8, 2
    generator = torch.Generator().manual_seed(2)
    x = torch.randn(rows, 16, generator=generator)
    weight = 100 * torch.randn((num_q + 2 * num_kv) * head_dim, 16, generator=generator)  # outputs past 448
    cache = torch.zeros(2, 4, BLOCK_SIZE, num_kv, head_dim, dtype=FP8)
    slots = torch.tensor([6, 9], dtype=torch.int64)
    rotary = RotaryKVWrite(torch.tensor([3, 11]), make_cache(16, head_dim), cache, slots, num_q, num_kv, head_dim)

    out = small_linear(x, weight, impl="triton", rotary=rotary, block_n=4)  # [rows, (Hq + 2 Hkv) D], rotated

    # the epilogue's own rotated k and v, cast as write_kv_reference casts them
    k, v = out[:, num_q * head_dim :].view(rows, 2, num_kv, head_dim).unbind(1)
    expected = torch.zeros_like(cache)
    write_kv_reference(k, v, expected, slots)
    assert_same_bits(cache, expected)
    assert cache.float().abs().max() == FP8_E4M3_MAX


def test_decode_kernel_rotates_writes_and_attends_over_an_fp8_cache():
    num_q, num_kv = 4, 2
    seq_lens, tables = [7, 13], [[1, 2], [3, 4, 5, 6]]
    generator = torch.Generator().manual_seed(3)
    qkv = torch.randn(2, (num_q + 2 * num_kv) * HEAD_DIM, generator=generator)
    qkv[:, num_q * HEAD_DIM :] *= 200  # new keys and values past 448
    cos_sin = make_cache(64, HEAD_DIM)
    positions = torch.tensor([n - 1 for n in seq_lens])
    metadata = AttentionMetadata.build([1, 1], seq_lens, tables, BLOCK_SIZE)
    results = []
    for fused in (True, False):
        cache = fp8_cache(num_blocks=7, num_kv_heads=num_kv, seed=4)
        data = qkv.clone()
        q, k = split_qkv(data, num_q, num_kv, HEAD_DIM)
        v = data[:, (num_q + num_kv) * HEAD_DIM :].view(2, num_kv, HEAD_DIM)
        if fused:
            new_kv = NewKV(k, v, positions, cos_sin, metadata.slot_mapping)
            out = paged_decode_attention(q, cache, metadata, SCALE, num_splits=2, block_n=16, new_kv=new_kv)
        else:
            rotary_write_kv_reference(q, k, v, positions, cos_sin, cache, metadata.slot_mapping)
            out = paged_attention_reference(q, cache, metadata, SCALE)
        results.append((out, cache))

    (out, cache), (expected, expected_cache) = results
    assert_same_bits(cache, expected_cache)
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=1e-5)  # fp32 over the same dequantised values


def test_decode_and_mixed_batches_attend_over_an_fp8_cache_as_the_reference():
    cache = fp8_cache(num_blocks=20, num_kv_heads=2)
    generator = torch.Generator().manual_seed(5)
    # a decode-only batch over 4 splits (GQA 4:2)
    decodes = AttentionMetadata.build([1, 1, 1], [37, 5, 32], [list(range(19, 9, -1)), [3, 8], list(range(1, 9))],
                                      BLOCK_SIZE)
    query = torch.randn(3, 4, HEAD_DIM, generator=generator)
    out = paged_decode_attention(query, cache, decodes, SCALE, num_splits=4, block_n=16)
    torch.testing.assert_close(out, paged_attention_reference(query, cache, decodes, SCALE), atol=2e-5, rtol=1e-5)
    # a mixed step: two decodes on the decode kernel, then a chunk over a cached prefix on the prefill kernel
    mixed = AttentionMetadata.build([1, 1, 6], [9, 4, 11], [[2, 5, 7], [9], [11, 12, 13]], BLOCK_SIZE)
    query = torch.randn(8, 4, HEAD_DIM, generator=generator)
    out = paged_attention(query, cache, mixed, SCALE, impl="triton", prefill=PrefillLaunch(decode_rows=True))
    torch.testing.assert_close(out, paged_attention_reference(query, cache, mixed, SCALE), atol=2e-5, rtol=1e-5)
