"""Programmatic dependent launch: off on CPU, and on the GPU chains of PDL kernels (eager and
CUDA-graph replayed) give bit-identical results to plain launches."""

import pytest
import torch

from cleave.kernels.pdl import pdl_enabled
from cleave.kernels.small_linear import small_linear


def test_pdl_is_off_for_cpu_tensors():
    assert not pdl_enabled(torch.zeros(1))
    assert not pdl_enabled(torch.zeros(1), enabled=False)


def _decode_block(residual, weights, pdl):
    norm, qkv, o, gate_up, down = weights
    for _ in range(3):
        act = small_linear(residual, qkv, norm_weight=norm, pdl=pdl)
        small_linear(act[:, : o.shape[1]], o, add_to=residual, pdl=pdl)
        act = small_linear(residual, gate_up, gated=True, norm_weight=norm, pdl=pdl)
        small_linear(act, down, add_to=residual, pdl=pdl)
    return residual


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 16])
def test_gpu_pdl_chain_matches_plain_launches_bitwise(rows):
    generator = torch.Generator(device="cuda").manual_seed(0)

    def randn(*shape, scale=0.05):
        return (torch.randn(*shape, generator=generator, device="cuda") * scale).to(torch.bfloat16)

    hidden, inter = 1024, 2816
    # input norm, qkv, o, gate_up, down
    weights = (1 + randn(hidden), randn(3 * hidden, hidden), randn(hidden, hidden),
               randn(2 * inter, hidden), randn(hidden, inter))
    start = randn(rows, hidden, scale=1.0)

    expected = _decode_block(start.clone(), weights, pdl=False)
    eager = _decode_block(start.clone(), weights, pdl=True)
    torch.testing.assert_close(eager, expected, rtol=0, atol=0)

    static = start.clone()
    _decode_block(static.clone(), weights, pdl=True)  # compile outside capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _decode_block(static, weights, pdl=True)
    for _ in range(2):  # each replay continues from the last one's residual
        static.copy_(start)
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(static, expected, rtol=0, atol=0)


def _rotate_then_attend(query, key, value, positions, cos_sin, cache, metadata, pdl):
    from cleave.kernels.attention_decode import paged_decode_attention
    from cleave.kernels.rotary_kv_write import rotary_write_kv

    rotary_write_kv(query, key, value, positions, cos_sin, cache, metadata.slot_mapping, pdl=pdl)
    return paged_decode_attention(query, cache, metadata, 0.125, pdl=pdl)


@pytest.mark.gpu
def test_gpu_decode_attention_sees_the_kv_the_kernel_before_it_wrote():
    # Decode attention loads its first KV tile before waiting on the previous kernel; the
    # newest position, written by that kernel, must be reloaded after the wait. Its slot is
    # poisoned before every run, so a stale read would show.
    from cleave.kv.metadata import AttentionMetadata

    generator = torch.Generator(device="cuda").manual_seed(0)
    block_size, num_kv_heads, num_q_heads, head_dim = 16, 8, 32, 64
    seq_lens = [1, 5, 16, 17, 64, 65, 300, 1024]
    tables, next_block = [], 1
    for seq_len in seq_lens:
        count = -(-seq_len // block_size)
        tables.append(list(range(next_block, next_block + count)))
        next_block += count
    metadata = AttentionMetadata.build([1] * len(seq_lens), seq_lens, tables, block_size, device="cuda")
    cache = torch.randn(2, next_block, block_size, num_kv_heads, head_dim, generator=generator, device="cuda").to(
        torch.bfloat16
    )
    query = torch.randn(len(seq_lens), num_q_heads, head_dim, generator=generator, device="cuda").to(torch.bfloat16)
    key = torch.randn(len(seq_lens), num_kv_heads, head_dim, generator=generator, device="cuda").to(torch.bfloat16)
    value = torch.randn_like(key)
    positions = torch.tensor([n - 1 for n in seq_lens], device="cuda")
    cos_sin = torch.rand(1024, head_dim, generator=generator, device="cuda")
    slots = metadata.slot_mapping

    def poisoned_cache():
        fresh = cache.clone()
        fresh.view(2, -1, num_kv_heads, head_dim)[:, slots] = 1000.0
        return fresh

    expected = _rotate_then_attend(query.clone(), key, value, positions, cos_sin, poisoned_cache(), metadata, pdl=False)
    for _ in range(5):
        out = _rotate_then_attend(query.clone(), key, value, positions, cos_sin, poisoned_cache(), metadata, pdl=True)
        torch.testing.assert_close(out, expected, rtol=0, atol=0)

    static_query, static_cache = query.clone(), poisoned_cache()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = _rotate_then_attend(static_query, key, value, positions, cos_sin, static_cache, metadata, pdl=True)
    for _ in range(5):
        static_query.copy_(query)
        static_cache.copy_(poisoned_cache())
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(static_out, expected, rtol=0, atol=0)
