"""Triton paged decode attention with split-KV (flash-decoding) and GQA packing.

Each sequence has one new query token. Its context is cut into partitions of
`partition_size` tokens; program (split, sequence, kv head) attends the query heads that
share that KV head (packed as the M dimension of `tl.dot`, padded to 16) over one
partition, so each KV block is read from HBM once per KV head. It writes a partial
result (running max, sum of exponentials, unnormalised accumulator), and a second kernel
merges the partials of every split into the output.

The split count comes from `metadata.max_seq_len`, which under CUDA graphs is the
configured capacity, so the grid is static; programs whose partition starts past the
sequence's length exit at once and the reduction reads only the splits that ran.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from cleave.kernels.attention_common import LOG2E, dot_settings
from cleave.kv.metadata import AttentionMetadata

MIN_PARTITION_SIZE = 512
# Split programs per launch worth having: enough to fill the GPU at batch 1, few enough
# that at a large batch and a long capacity the programs that exit early stay cheap.
MAX_SPLIT_PROGRAMS = 8192


@triton.jit
def _paged_decode_split_kernel(
    query_ptr,  # [T, Hq, D]
    cache_ptr,  # [2, num_blocks, block_size, Hkv, D]
    part_max_ptr,  # [B, Hq, S] fp32
    part_sum_ptr,  # [B, Hq, S] fp32
    part_acc_ptr,  # [B, Hq, S, D] fp32
    query_start_loc_ptr,  # [B + 1] int32
    seq_lens_ptr,  # [B] int32
    block_tables_ptr,  # [B, max_blocks_per_seq] int32
    scale_log2,
    stride_q_token,
    stride_q_head,
    stride_cache_kv,
    stride_cache_block,
    stride_cache_slot,
    stride_cache_head,
    stride_table_seq,
    block_size,
    num_splits,
    QUERIES_PER_KV: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PARTITION_SIZE: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    split = tl.program_id(0)
    seq = tl.program_id(1)
    kv_head = tl.program_id(2)

    seq_len = tl.load(seq_lens_ptr + seq)
    part_start = split * PARTITION_SIZE
    if part_start >= seq_len:
        return
    q_token = tl.load(query_start_loc_ptr + seq)
    if tl.load(query_start_loc_ptr + seq + 1) == q_token:
        return
    part_end = tl.minimum(seq_len, part_start + PARTITION_SIZE)

    group = tl.arange(0, BLOCK_G)  # [BLOCK_G] query heads of this KV head
    dims = tl.arange(0, BLOCK_D)
    group_valid = group < QUERIES_PER_KV
    dim_valid = dims < HEAD_DIM
    q_heads = kv_head * QUERIES_PER_KV + group
    q = tl.load(
        query_ptr + q_token.to(tl.int64) * stride_q_token + q_heads[:, None] * stride_q_head + dims[None, :],
        mask=group_valid[:, None] & dim_valid[None, :],
        other=0.0,
    ).to(DOT_DTYPE)  # [BLOCK_G, BLOCK_D]

    m_i = tl.full([BLOCK_G], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)

    table_row = block_tables_ptr + seq.to(tl.int64) * stride_table_seq
    for start in range(part_start, part_end, BLOCK_N):
        keys_pos = start + tl.arange(0, BLOCK_N)  # [BLOCK_N]
        key_valid = keys_pos < part_end
        block_ids = tl.load(table_row + keys_pos // block_size, mask=key_valid, other=0).to(tl.int64)
        slot_base = (
            block_ids * stride_cache_block
            + (keys_pos % block_size) * stride_cache_slot
            + kv_head * stride_cache_head
        )  # [BLOCK_N]
        kv_mask = key_valid[:, None] & dim_valid[None, :]
        k = tl.load(cache_ptr + slot_base[:, None] + dims[None, :], mask=kv_mask, other=0.0)  # [BLOCK_N, BLOCK_D]
        v = tl.load(cache_ptr + stride_cache_kv + slot_base[:, None] + dims[None, :], mask=kv_mask, other=0.0)

        scores = tl.dot(q, tl.trans(k.to(DOT_DTYPE)), input_precision=DOT_PRECISION) * scale_log2  # [BLOCK_G, BLOCK_N]
        scores = tl.where(key_valid[None, :], scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(DOT_DTYPE), v.to(DOT_DTYPE), acc, input_precision=DOT_PRECISION)
        m_i = m_new

    part_row = (seq.to(tl.int64) * (QUERIES_PER_KV * tl.num_programs(2)) + q_heads) * num_splits + split  # [BLOCK_G]
    tl.store(part_max_ptr + part_row, m_i, mask=group_valid)
    tl.store(part_sum_ptr + part_row, l_i, mask=group_valid)
    tl.store(
        part_acc_ptr + part_row[:, None] * HEAD_DIM + dims[None, :],
        acc,
        mask=group_valid[:, None] & dim_valid[None, :],
    )


@triton.jit
def _paged_decode_reduce_kernel(
    out_ptr,  # [T, Hq, D]
    part_max_ptr,  # [B, Hq, S] fp32
    part_sum_ptr,  # [B, Hq, S] fp32
    part_acc_ptr,  # [B, Hq, S, D] fp32
    query_start_loc_ptr,  # [B + 1] int32
    seq_lens_ptr,  # [B] int32
    stride_o_token,
    stride_o_head,
    num_splits,
    HEAD_DIM: tl.constexpr,
    PARTITION_SIZE: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    seq = tl.program_id(0)
    q_head = tl.program_id(1)
    q_token = tl.load(query_start_loc_ptr + seq)
    if tl.load(query_start_loc_ptr + seq + 1) == q_token:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    num_valid = (seq_len + PARTITION_SIZE - 1) // PARTITION_SIZE

    dims = tl.arange(0, BLOCK_D)
    dim_valid = dims < HEAD_DIM
    row0 = (seq.to(tl.int64) * tl.num_programs(1) + q_head) * num_splits
    total_max = tl.full([1], -1.0e30, dtype=tl.float32)
    total_sum = tl.zeros([1], dtype=tl.float32)
    total_acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for chunk in range(0, num_valid, BLOCK_S):
        splits = chunk + tl.arange(0, BLOCK_S)  # [BLOCK_S]
        split_valid = splits < num_valid
        part_max = tl.load(part_max_ptr + row0 + splits, mask=split_valid, other=-1.0e30)
        part_sum = tl.load(part_sum_ptr + row0 + splits, mask=split_valid, other=0.0)
        part_acc = tl.load(
            part_acc_ptr + (row0 + splits)[:, None] * HEAD_DIM + dims[None, :],
            mask=split_valid[:, None] & dim_valid[None, :],
            other=0.0,
        )  # [BLOCK_S, BLOCK_D]
        new_max = tl.maximum(total_max, tl.max(part_max, axis=0))  # [1]
        weights = tl.exp2(part_max - new_max)  # [BLOCK_S]
        rescale = tl.exp2(total_max - new_max)  # [1]
        total_sum = total_sum * rescale + tl.sum(part_sum * weights, axis=0)
        total_acc = total_acc * rescale + tl.sum(part_acc * weights[:, None], axis=0)
        total_max = new_max

    # A padding sequence (seq_len 0) ran no split: write zeros, not 0/0.
    safe_sum = tl.where(total_sum > 0.0, total_sum, 1.0)
    out = total_acc / safe_sum
    tl.store(
        out_ptr + q_token.to(tl.int64) * stride_o_token + q_head * stride_o_head + dims,
        out.to(out_ptr.dtype.element_ty),
        mask=dim_valid,
    )


def choose_partition_size(max_seq_len: int, num_seqs: int, num_kv_heads: int) -> int:
    """Tokens per split: MIN_PARTITION_SIZE, doubled until the grid fits MAX_SPLIT_PROGRAMS.

    Depends only on host ints (under CUDA graphs: the capacity and the bucket size).
    """
    max_splits = max(1, MAX_SPLIT_PROGRAMS // max(1, num_seqs * num_kv_heads))
    return max(MIN_PARTITION_SIZE, triton.next_power_of_2(triton.cdiv(max(max_seq_len, 1), max_splits)))


def num_decode_splits(max_seq_len: int, partition_size: int) -> int:
    """Splits per sequence for a context capacity of `max_seq_len` tokens."""
    return max(1, triton.cdiv(max_seq_len, partition_size))


def paged_decode_attention(
    query: torch.Tensor,  # [T, Hq, D], one token per sequence
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, Hkv, D]
    metadata: AttentionMetadata,
    scale: float,
    partition_size: int | None = None,
    block_n: int = 64,
) -> torch.Tensor:  # [T, Hq, D]
    """Split-KV decode attention: every sequence's single new token over its paged context.

    `partition_size` (tokens per split, a power of two) defaults to `choose_partition_size`.
    """
    num_tokens, num_q_heads, head_dim = query.shape
    num_kv_heads = kv_cache.shape[3]
    if num_q_heads % num_kv_heads:
        raise ValueError(f"{num_q_heads} query heads are not a multiple of {num_kv_heads} KV heads")
    if query.stride(-1) != 1 or kv_cache.stride(-1) != 1:
        raise ValueError("paged attention needs the head dimension contiguous in query and kv_cache")
    if partition_size is None:
        partition_size = choose_partition_size(metadata.max_seq_len, metadata.num_seqs, num_kv_heads)
    if partition_size % block_n or partition_size & (partition_size - 1):
        raise ValueError(f"partition_size {partition_size} must be a power of two and a multiple of {block_n}")
    dot_dtype, precision = dot_settings(query)
    out = torch.empty_like(query)
    num_seqs = metadata.num_seqs
    if num_tokens == 0 or num_seqs == 0:
        return out
    num_splits = num_decode_splits(metadata.max_seq_len, partition_size)
    part_max = torch.empty((num_seqs, num_q_heads, num_splits), dtype=torch.float32, device=query.device)
    part_sum = torch.empty_like(part_max)
    part_acc = torch.empty((num_seqs, num_q_heads, num_splits, head_dim), dtype=torch.float32, device=query.device)
    queries_per_kv = num_q_heads // num_kv_heads
    block_d = max(16, triton.next_power_of_2(head_dim))
    _paged_decode_split_kernel[(num_splits, num_seqs, num_kv_heads)](
        query,
        kv_cache,
        part_max,
        part_sum,
        part_acc,
        metadata.query_start_loc,
        metadata.seq_lens,
        metadata.block_tables,
        scale * LOG2E,
        query.stride(0),
        query.stride(1),
        kv_cache.stride(0),
        kv_cache.stride(1),
        kv_cache.stride(2),
        kv_cache.stride(3),
        metadata.block_tables.stride(0),
        kv_cache.shape[2],
        num_splits,
        QUERIES_PER_KV=queries_per_kv,
        HEAD_DIM=head_dim,
        PARTITION_SIZE=partition_size,
        BLOCK_G=max(16, triton.next_power_of_2(queries_per_kv)),
        BLOCK_N=block_n,
        BLOCK_D=block_d,
        DOT_DTYPE=dot_dtype,
        DOT_PRECISION=precision,
    )
    _paged_decode_reduce_kernel[(num_seqs, num_q_heads)](
        out,
        part_max,
        part_sum,
        part_acc,
        metadata.query_start_loc,
        metadata.seq_lens,
        out.stride(0),
        out.stride(1),
        num_splits,
        HEAD_DIM=head_dim,
        PARTITION_SIZE=partition_size,
        BLOCK_S=min(32, triton.next_power_of_2(num_splits)),
        BLOCK_D=block_d,
    )
    return out
