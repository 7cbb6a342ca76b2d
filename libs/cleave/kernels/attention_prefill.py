"""Triton paged prefill attention: varlen, causal, GQA, over a cached prefix.

Queries of sequence `b` are the last `query_len` positions of a context of `seq_lens[b]`
tokens; every key (cached prefix and the new tokens, already written by `write_kv`) is
read from the paged cache through `block_tables`. One program handles one block of
BLOCK_M queries of one query head of one sequence with a flash-attention online softmax
in fp32. The grid comes from host ints only (`max_query_len`, `num_seqs`), so the launch
is CUDA-graph safe; programs past a sequence's query length exit at once. With a sliding
window W, a query at position i sees keys i - W + 1 .. i, and the key loop starts at the
first tile any query of the block can see.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from cleave.kernels.attention_common import LOG2E, add_sinks, attend_tile, dot_settings, kv_tile_pointers
from cleave.kernels.dispatch import CachedLauncher
from cleave.kv.metadata import AttentionMetadata


@triton.jit
def _paged_prefill_kernel(
    query_ptr,  # [T, Hq, D]
    cache_ptr,  # [2, num_blocks, block_size, Hkv, D]
    out_ptr,  # [T, Hq, D]
    query_start_loc_ptr,  # [B + 1] int32
    seq_lens_ptr,  # [B] int32
    block_tables_ptr,  # [B, max_blocks_per_seq] int32
    sinks_ptr,  # HAS_SINKS: [Hq] fp32 per-head sink logits
    scale_log2,  # softmax scale * log2(e)
    stride_q_token,
    stride_q_head,
    stride_o_token,
    stride_o_head,
    stride_cache_kv,
    stride_cache_block,
    stride_cache_slot,
    stride_cache_head,
    stride_table_seq,
    block_size,
    window,  # sliding window in tokens (used when SLIDING)
    QUERIES_PER_KV: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    SLIDING: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    query_block = tl.program_id(0)
    seq = tl.program_id(1)
    q_head = tl.program_id(2)
    kv_head = q_head // QUERIES_PER_KV

    q_start = tl.load(query_start_loc_ptr + seq)
    query_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    if query_block * BLOCK_M >= query_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - query_len

    rows = query_block * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M] query index in the sequence
    dims = tl.arange(0, BLOCK_D)
    row_valid = rows < query_len
    dim_valid = dims < HEAD_DIM
    q_tokens = (q_start + rows).to(tl.int64)
    q = tl.load(
        query_ptr + q_tokens[:, None] * stride_q_token + q_head * stride_q_head + dims[None, :],
        mask=row_valid[:, None] & dim_valid[None, :],
        other=0.0,
    ).to(DOT_DTYPE)  # [BLOCK_M, BLOCK_D]
    q_pos = context_len + rows  # [BLOCK_M] absolute positions

    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    table_row = block_tables_ptr + seq.to(tl.int64) * stride_table_seq
    kv_end = tl.minimum(seq_len, context_len + (query_block + 1) * BLOCK_M)
    kv_start = 0
    if SLIDING:  # the block's first query sees nothing before its own window
        kv_start = tl.maximum(context_len + query_block * BLOCK_M - window + 1, 0) // BLOCK_N * BLOCK_N
    for start in range(kv_start, kv_end, BLOCK_N):
        k_ptrs, v_ptrs, key_valid, kv_mask = kv_tile_pointers(
            cache_ptr, table_row, start, kv_end, kv_head, dims, dim_valid, block_size,
            stride_cache_kv, stride_cache_block, stride_cache_slot, stride_cache_head, BLOCK_N,
        )
        k = tl.load(k_ptrs, mask=kv_mask, other=0.0)  # [BLOCK_N, BLOCK_D]
        v = tl.load(v_ptrs, mask=kv_mask, other=0.0)
        keys_pos = start + tl.arange(0, BLOCK_N)  # [BLOCK_N]
        visible = (keys_pos[None, :] <= q_pos[:, None]) & key_valid[None, :]
        if SLIDING:
            visible = visible & (keys_pos[None, :] > q_pos[:, None] - window)
        m_i, l_i, acc = attend_tile(q, k, v, visible, m_i, l_i, acc, scale_log2, DOT_DTYPE, DOT_PRECISION)

    if HAS_SINKS:
        heads = q_head + tl.zeros([BLOCK_M], dtype=tl.int32)
        m_i, l_i, acc = add_sinks(sinks_ptr, heads, row_valid, m_i, l_i, acc)
    # A padding sequence (seq_len 0) sees no key: write zeros, not 0/0.
    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    out = acc / l_safe[:, None]
    tl.store(
        out_ptr + q_tokens[:, None] * stride_o_token + q_head * stride_o_head + dims[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=row_valid[:, None] & dim_valid[None, :],
    )


_prefill_launcher = CachedLauncher(_paged_prefill_kernel)


def paged_prefill_attention(
    query: torch.Tensor,  # [T, Hq, D]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, Hkv, D]
    metadata: AttentionMetadata,
    scale: float,
    block_m: int = 64,
    block_n: int = 64,
    sliding_window: int | None = None,
    sinks: torch.Tensor | None = None,  # [Hq] fp32
    num_warps: int = 4,
    num_stages: int | None = None,  # None: triton's default
) -> torch.Tensor:  # [T, Hq, D]
    """Causal varlen attention of every sequence's new tokens over its paged context
    (only the last `sliding_window` positions of it per query, when given; `sinks`: one
    extra softmax logit per query head, with no value). The tiles, warps and pipeline
    stages are bench/attention_prefill.py's to sweep."""
    num_tokens, num_q_heads, head_dim = query.shape
    num_kv_heads = kv_cache.shape[3]
    if num_q_heads % num_kv_heads:
        raise ValueError(f"{num_q_heads} query heads are not a multiple of {num_kv_heads} KV heads")
    if query.stride(-1) != 1 or kv_cache.stride(-1) != 1:
        raise ValueError("paged attention needs the head dimension contiguous in query and kv_cache")
    dot_dtype, precision = dot_settings(query)
    out = torch.empty_like(query)
    if num_tokens == 0 or metadata.num_seqs == 0:
        return out
    block_m = max(16, min(block_m, triton.next_power_of_2(max(metadata.max_query_len, 1))))
    grid = (triton.cdiv(max(metadata.max_query_len, 1), block_m), metadata.num_seqs, num_q_heads)
    queries_per_kv = num_q_heads // num_kv_heads
    _prefill_launcher(
        grid,
        (query, kv_cache, out, metadata.query_start_loc, metadata.seq_lens, metadata.block_tables,
         sinks if sinks is not None else query,
         scale * LOG2E, query.stride(0), query.stride(1), out.stride(0), out.stride(1),
         kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
         metadata.block_tables.stride(0), kv_cache.shape[2], sliding_window or 0),
        (queries_per_kv, head_dim, bool(sliding_window), sinks is not None, block_m, block_n,
         max(16, triton.next_power_of_2(head_dim)), dot_dtype, precision),
        num_warps,
        **({} if num_stages is None else {"num_stages": num_stages}),
    )
    return out
