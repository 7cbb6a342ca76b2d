"""Triton paged prefill attention: varlen, causal, GQA, over a cached prefix.

Queries of sequence `b` are the last `query_len` positions of a context of `seq_lens[b]`
tokens; every key (cached prefix and the new tokens, already written by `write_kv`) is
read from the paged cache through `block_tables`. One program handles BLOCK_M rows of one
sequence with a flash-attention online softmax in fp32: BLOCK_M queries of one query head,
or (`pack_gqa`) BLOCK_M / G queries of each of the G query heads that share a KV head, so
each K/V tile is gathered once for the group, not once per head. The grid comes from host
ints only (`max_query_len`, `num_seqs`), so the launch is CUDA-graph safe; programs past a
sequence's query length exit at once. With a sliding window W, a query at position i sees
keys i - W + 1 .. i, and the key loop starts at the first tile any query of the block can
see.

Two launch options change only the order of work: `causal_split` walks the tiles every
query of the block sees without any mask and masks only the tiles on the diagonal;
`heavy_first` orders the grid query block slowest and last block first, so the blocks with
the most keys start first and the short ones fill the tail.

A mixed batch (decodes first, then prompt chunks) gives each decode a program per query
head (per KV head with `pack_gqa`) of BLOCK_M rows with one of them a query, walking its
whole context alone. `PrefillLaunch.decode_rows` (the default) sends those leading
single-token sequences to the split-KV decode kernel instead (`paged_attention`; `first_seq`
here starts the grid after them): at 248 decodes of 1k context beside 3848 prompt tokens the
layer's attention took 215 us instead of 632 (H100, bench/results/prefill/attention_mixed-*).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
import triton
import triton.language as tl

from cleave.kernels.attention_common import LOG2E, add_sinks, attend_tile, dot_settings, kv_tile_pointers, load_kv_tile
from cleave.kernels.dispatch import CachedLauncher
from cleave.kv.metadata import AttentionMetadata


@triton.jit
def _kv_tile(
    cache_ptr, table_row, start, end, kv_head, dims, dim_valid, block_size,
    stride_cache_kv, stride_cache_block, stride_cache_slot, stride_cache_head, BLOCK_N: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
):
    """K and V [BLOCK_N, BLOCK_D] in DOT_DTYPE of the cached positions [start, start + BLOCK_N)
    of one KV head (zeros at and past `end`), and which of those positions are below `end`."""
    k_ptrs, v_ptrs, key_valid, kv_mask = kv_tile_pointers(
        cache_ptr, table_row, start, end, kv_head, dims, dim_valid, block_size,
        stride_cache_kv, stride_cache_block, stride_cache_slot, stride_cache_head, BLOCK_N,
    )
    k, v = load_kv_tile(k_ptrs, v_ptrs, kv_mask, DOT_DTYPE)
    return k, v, key_valid


@triton.jit(do_not_specialize=["stride_table_seq", "first_seq"])
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
    first_seq,  # the batch's first sequence this launch attends (the grid covers those after it)
    QUERIES_PER_KV: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    SLIDING: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    BLOCK_M: tl.constexpr,  # rows: BLOCK_M // GROUP queries x GROUP head slots
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    GROUP: tl.constexpr,  # 1: one query head a program; else the KV head's QUERIES_PER_KV (padded to 2^k)
    HEAVY_FIRST: tl.constexpr,
    CAUSAL_SPLIT: tl.constexpr,
):
    BLOCK_Q: tl.constexpr = BLOCK_M // GROUP
    if HEAVY_FIRST:  # grid (head slots, sequences, query blocks), the last query block first
        head_slot = tl.program_id(0)
        seq = first_seq + tl.program_id(1)
        query_block = tl.num_programs(2) - 1 - tl.program_id(2)
    else:  # grid (query blocks, sequences, head slots)
        query_block = tl.program_id(0)
        seq = first_seq + tl.program_id(1)
        head_slot = tl.program_id(2)
    if GROUP == 1:  # the slot is a query head
        kv_head = head_slot // QUERIES_PER_KV
        first_head = head_slot
        num_heads = 1
    else:  # the slot is a KV head
        kv_head = head_slot
        first_head = head_slot * QUERIES_PER_KV
        num_heads = QUERIES_PER_KV

    q_start = tl.load(query_start_loc_ptr + seq)
    query_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    if query_block * BLOCK_Q >= query_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - query_len

    lanes = tl.arange(0, BLOCK_M)
    rows = query_block * BLOCK_Q + lanes // GROUP  # [BLOCK_M] query index in the sequence
    heads = first_head + lanes % GROUP  # [BLOCK_M] query head of each row
    dims = tl.arange(0, BLOCK_D)
    row_valid = (rows < query_len) & (lanes % GROUP < num_heads)
    dim_valid = dims < HEAD_DIM
    q_tokens = (q_start + rows).to(tl.int64)
    q = tl.load(
        query_ptr + q_tokens[:, None] * stride_q_token + heads[:, None] * stride_q_head + dims[None, :],
        mask=row_valid[:, None] & dim_valid[None, :],
        other=0.0,
    ).to(DOT_DTYPE)  # [BLOCK_M, BLOCK_D]
    q_pos = context_len + rows  # [BLOCK_M] absolute positions

    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    table_row = block_tables_ptr + seq.to(tl.int64) * stride_table_seq
    first_query_pos = context_len + query_block * BLOCK_Q
    kv_end = tl.minimum(seq_len, first_query_pos + BLOCK_Q)
    kv_start = 0
    if SLIDING:  # the block's first query sees nothing before its own window
        kv_start = tl.maximum(first_query_pos - window + 1, 0) // BLOCK_N * BLOCK_N
    elif CAUSAL_SPLIT:  # whole tiles before the block's first query: every row sees every key
        full_end = first_query_pos // BLOCK_N * BLOCK_N
        for start in range(0, full_end, BLOCK_N):
            k, v, key_valid = _kv_tile(cache_ptr, table_row, start, full_end, kv_head, dims, dim_valid, block_size,
                                       stride_cache_kv, stride_cache_block, stride_cache_slot, stride_cache_head,
                                       BLOCK_N, DOT_DTYPE)
            m_i, l_i, acc = attend_tile(q, k, v, key_valid[None, :], m_i, l_i, acc, scale_log2, DOT_DTYPE,
                                        DOT_PRECISION, MASKED=False)
        kv_start = full_end
    for start in range(kv_start, kv_end, BLOCK_N):
        k, v, key_valid = _kv_tile(cache_ptr, table_row, start, kv_end, kv_head, dims, dim_valid, block_size,
                                   stride_cache_kv, stride_cache_block, stride_cache_slot, stride_cache_head, BLOCK_N,
                                   DOT_DTYPE)
        keys_pos = start + tl.arange(0, BLOCK_N)  # [BLOCK_N]
        visible = (keys_pos[None, :] <= q_pos[:, None]) & key_valid[None, :]
        if SLIDING:
            visible = visible & (keys_pos[None, :] > q_pos[:, None] - window)
        m_i, l_i, acc = attend_tile(q, k, v, visible, m_i, l_i, acc, scale_log2, DOT_DTYPE, DOT_PRECISION)

    if HAS_SINKS:
        m_i, l_i, acc = add_sinks(sinks_ptr, heads, row_valid, m_i, l_i, acc)
    # A padding sequence (seq_len 0) sees no key: write zeros, not 0/0.
    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    out = acc / l_safe[:, None]
    tl.store(
        out_ptr + q_tokens[:, None] * stride_o_token + heads[:, None] * stride_o_head + dims[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=row_valid[:, None] & dim_valid[None, :],
    )


_prefill_launcher = CachedLauncher(_paged_prefill_kernel)


MAX_GRID_Z = 65535  # CUDA's limit on a grid's third dimension (`heavy_first` puts query blocks there)


@dataclass(frozen=True)
class PrefillLaunch:
    """How a model's layers launch `paged_prefill_attention`: its keyword arguments past the
    attention's own (tiles, warps, pipeline stages and the work-order options; see the module
    docstring). These defaults are the function's (it reads them from here)."""

    block_m: int = 64
    block_n: int = 64
    num_warps: int = 4
    num_stages: int | None = None
    pack_gqa: bool = False
    heavy_first: bool = False
    causal_split: bool = False
    decode_rows: bool = True  # a mixed batch's leading decodes on the decode kernel (`paged_attention`)
    # a lone prompt with no cached prefix on torch's dense SDPA (`cleave.kernels.attention_fresh`),
    # on the SDPA backend named ("auto": torch's choice; "flash", "cudnn", "efficient"), its KV
    # heads repeated for the query heads, or not (`dense_gqa`: SDPA's enable_gqa)
    dense_fresh: bool = False
    dense_backend: str = "auto"
    dense_gqa: bool = False

    def kernel_options(self) -> dict[str, int | bool | None]:
        """The keyword arguments `paged_prefill_attention` takes from this launch."""
        options = asdict(self)
        for name in ("decode_rows", "dense_fresh", "dense_backend", "dense_gqa"):
            del options[name]
        return options


DEFAULT_PREFILL_LAUNCH = PrefillLaunch()
# By head size, the launch of the fastest setting of bench/attention_prefill.py's sweeps at 8192
# tokens on the H200 (bench/results/prefill/attention_prefill-20261206T03*): 32:8:64 heads 1305 ->
# 868 us a layer, 32:4:128 heads 1703 us (8 warps: 1882); an 8k Llama-3.2-1B prefill 46.3 ->
# 39.8 ms, Qwen3-30B-A3B's 218 -> 193 ms with the launches nearest these. A lone fresh prompt
# goes to dense SDPA with grouped KV heads: on an H100 (bench/results/prefill/*-20261206T0734*,
# bench/results/moe/moe-prefill-20261206T073509Z.md) one layer's attention takes 618 us for
# 32:8:64 heads (the kernel: 874) and 929 us for 32:4:128 (1704); the 8k Llama prefill 41.3 ->
# 38.4 ms (transformers 52.1) and Qwen3-30B-A3B's 242.5 -> 214.0 ms.
TUNED_PREFILL_LAUNCHES = {
    64: PrefillLaunch(block_m=128, block_n=64, num_warps=8, heavy_first=True, causal_split=True, dense_fresh=True,
                      dense_gqa=True),
    128: PrefillLaunch(block_m=128, block_n=64, num_warps=4, heavy_first=True, causal_split=True, dense_fresh=True,
                       dense_gqa=True),
}


def prefill_launch_for(head_dim: int) -> PrefillLaunch:
    """The launch a model's attention layers start with: the tuned one of the smallest tuned head
    size that holds `head_dim`, else (larger heads) the function's defaults."""
    fitting = [size for size in TUNED_PREFILL_LAUNCHES if head_dim <= size]
    return TUNED_PREFILL_LAUNCHES[min(fitting)] if fitting else DEFAULT_PREFILL_LAUNCH


def paged_prefill_attention(
    query: torch.Tensor,  # [T, Hq, D]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, Hkv, D]
    metadata: AttentionMetadata,
    scale: float,
    block_m: int = DEFAULT_PREFILL_LAUNCH.block_m,
    block_n: int = DEFAULT_PREFILL_LAUNCH.block_n,
    sliding_window: int | None = None,
    sinks: torch.Tensor | None = None,  # [Hq] fp32
    num_warps: int = DEFAULT_PREFILL_LAUNCH.num_warps,
    num_stages: int | None = DEFAULT_PREFILL_LAUNCH.num_stages,  # None: triton's default
    pack_gqa: bool = DEFAULT_PREFILL_LAUNCH.pack_gqa,
    heavy_first: bool = DEFAULT_PREFILL_LAUNCH.heavy_first,
    causal_split: bool = DEFAULT_PREFILL_LAUNCH.causal_split,
    first_seq: int = 0,
    out: torch.Tensor | None = None,  # [T, Hq, D]
) -> torch.Tensor:  # [T, Hq, D]
    """Causal varlen attention of every sequence's new tokens over its paged context
    (only the last `sliding_window` positions of it per query, when given; `sinks`: one
    extra softmax logit per query head, with no value).

    `block_m` is a program's rows (queries x heads with `pack_gqa`), `block_n` its KV tile;
    `pack_gqa`, `heavy_first` and `causal_split` are described in the module docstring. The
    tiles, warps, stages and options are bench/attention_prefill.py's to sweep.

    `first_seq` > 0 attends only the sequences from that one on, writing their rows of `out`
    (allocated when None; the other rows are left as they are): a mixed batch's leading
    decodes go to the decode kernel (`paged_attention`)."""
    num_tokens, num_q_heads, head_dim = query.shape
    num_kv_heads = kv_cache.shape[3]
    if num_q_heads % num_kv_heads:
        raise ValueError(f"{num_q_heads} query heads are not a multiple of {num_kv_heads} KV heads")
    if query.stride(-1) != 1 or kv_cache.stride(-1) != 1:
        raise ValueError("paged attention needs the head dimension contiguous in query and kv_cache")
    dot_dtype, precision = dot_settings(query)
    if out is None:
        out = torch.empty_like(query)
    num_seqs = metadata.num_seqs - first_seq
    if num_tokens == 0 or num_seqs <= 0:
        return out
    queries_per_kv = num_q_heads // num_kv_heads
    group = triton.next_power_of_2(queries_per_kv) if pack_gqa and queries_per_kv > 1 else 1
    block_q = min(max(1, block_m // group), triton.next_power_of_2(max(metadata.max_query_len, 1)))
    block_q = max(block_q, triton.cdiv(16, group))  # tl.dot takes at least 16 rows
    num_query_blocks = triton.cdiv(max(metadata.max_query_len, 1), block_q)
    head_slots = num_kv_heads if group > 1 else num_q_heads
    heavy_first = heavy_first and num_query_blocks <= MAX_GRID_Z  # else the blocks go where the grid has room
    if heavy_first:
        grid = (head_slots, num_seqs, num_query_blocks)
    else:
        grid = (num_query_blocks, num_seqs, head_slots)
    _prefill_launcher(
        grid,
        (query, kv_cache, out, metadata.query_start_loc, metadata.seq_lens, metadata.block_tables,
         sinks if sinks is not None else query,
         scale * LOG2E, query.stride(0), query.stride(1), out.stride(0), out.stride(1),
         kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
         metadata.block_tables.stride(0), kv_cache.shape[2], sliding_window or 0, first_seq),
        (queries_per_kv, head_dim, bool(sliding_window), sinks is not None, block_q * group, block_n,
         max(16, triton.next_power_of_2(head_dim)), dot_dtype, precision, group, heavy_first, causal_split),
        num_warps,
        **({} if num_stages is None else {"num_stages": num_stages}),
    )
    return out
