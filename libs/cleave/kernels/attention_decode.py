"""Triton paged decode attention with split-KV (flash-decoding) and GQA packing.

Each sequence has one new query token. Its context is cut into `num_splits` equal
partitions (rounded up to whole `BLOCK_N` tiles); program (split, sequence, kv head)
attends the query heads that share that KV head (packed as the M dimension of `tl.dot`,
padded to 16) over one partition, so each KV block is read from HBM once per KV head.

The split count depends only on the batch shape (sequences x KV heads, chosen so the grid
fills the GPU), never on the context: under CUDA graphs the grid is static while each
partition's length follows the sequence's actual length, read on the device. A short
context is spread over every split (one or two tiles each, so a batch-1 step is not a
serial walk over the context) and a long one gets long partitions. With one split, or a
context short enough for one, the kernel normalises and writes the output itself;
otherwise each split writes a partial result (running max, sum of exponentials,
unnormalised accumulator) and counts itself done on a per-(sequence, KV head) atomic
counter; the split that finishes last merges the partials and writes the output, then
zeroes the counter for the next launch. One launch per layer, no separate reduction
kernel. The counters live in `metadata.split_counters` (zeroed once, e.g. by the
CUDA-graph buffers) or are allocated zeroed per call.

With `new_kv` the kernel also takes the layer's rotary embedding and KV write (batches whose
qkv projection is a cuBLAS GEMM, which has no epilogue to carry them): every program
rotates its query heads in registers, and the program of each sequence's last split rotates
the new key into its cache slot and copies the value beside it before reading the tile
that holds it. One launch per layer fewer. `NewKV.row_norm` also applies the layer's input
RMSNorm there (`cleave.kernels.row_norm`): with the norm weight folded into the qkv weight,
q, k and v are the product of the unnormalised residual stream, and every program scales
its rows by the inverse RMS of its token's residual row.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from cleave.kernels.attention_common import LOG2E, add_sinks, attend_tile, dot_settings, kv_tile_pointers, load_kv_tile
from cleave.kernels.dispatch import CachedLauncher
from cleave.kernels.kv_cache_dtype import to_cache
from cleave.kernels.pdl import launch_options, pdl_enabled, release_dependents, wait_for_producer
from cleave.kernels.rotary import head_normed as _head_normed
from cleave.kernels.row_norm import DeferredRMSNorm, row_inverse_rms, row_norm_args
from cleave.kv.metadata import AttentionMetadata

# Programs per launch (splits x sequences x KV heads) the split count aims for: several
# resident CTAs per SM of a 132-SM GPU, so that at batch 1 the context is read by many SMs
# at once and at batch 32 / 32k each (sequence, KV head) still has 4 splits (measured on
# an H200 with 2 warps: 94% of HBM bandwidth there vs 82-86% with 1-2 splits;
# bench/results/decode/attention_decode.md).
TARGET_PROGRAMS = 1024
MAX_SPLITS = 256
# From this many splits (batches of up to ~16 sequences) partitions are short and each
# program's first tile is loaded before the PDL wait; with fewer, longer partitions the
# peeled first tile costs the pipelined loop more than it hides (batch 32 / 32k: 94% ->
# 86% of HBM when every launch prefetched).
PREFETCH_MIN_SPLITS = 8
# Grid order for batches of several sequences: KV head fastest, so the programs that read
# one block's heads (its rows are [block_size, Hkv, D]) run side by side. Inside the
# graph-replayed decode step on an H200 (bench/results/decode/deferred/attention_order*.md):
# batch 64 / 1k 1638.4 -> 1629.5 and 1757.8 -> 1747.5 us per step in two runs, batch 32 / 32k
# 9206 -> 9185 and 9341 -> 9037 us, batch 64 / 32k 17683 -> 16968 us; at batch 1 (one
# sequence, 128 splits) it was 2 us slower (793.8 -> 795.9 us), so one sequence keeps splits
# fastest.
HEADS_FIRST_MIN_SEQS = 2
# Warps of a decode program. Two read the tiles of 64-wide heads (Llama-3.2-1B: 4 query
# heads a KV head; gpt-oss-20b: 8) fastest (bench/results/decode/attention_decode.md); heads
# this wide or wider take four, which also merge twice the splits a chunk. Graph-replayed
# Qwen3-30B-A3B-shaped steps on an H100 (128-wide heads, 8 a KV head;
# bench/results/moe/moe-decode-20261205T213058Z.md, ...213106Z.md): batch 1 / 1k 3557 -> 3358
# us, batch 1 / 8k 4100 -> 3933 us, batch 64 / 1k 25420 -> 25386 us (eight warps: 3442 and
# 25368); gpt-oss-20b's batch 1 was 3101 -> 3137 us with four (...213121Z.md). Since the
# q/k head norms moved into the kernel, a lone sequence's step reads its wide heads fastest
# on eight (H100, bench/results/moe/moe-decode-20261206T074900Z.md, ...T075207Z.md: batch 1 / 1k
# 3060 -> 2958 and 3070 -> 2964 us in two runs; batch 64 / 1k 25018 -> 25113 us, so larger
# batches keep four). In the same runs gpt-oss-20b's lone sequence (8 query heads of 64 a KV
# head) was faster on four warps, 3038 -> 3021 and 3043 -> 3026 us (...T074923Z.md,
# ...T075224Z.md), and Llama-3.2-1B's (4 of 64) slower, 990 -> 998 us
# (bench/results/decode/attention_in_step-20261206T074840Z.md): one sequence's programs take
# four from GROUP_TILE_FOUR_WARPS query-head elements up.
WIDE_HEAD_DIM = 128
WIDE_HEAD_ONE_SEQUENCE_WARPS = 8
GROUP_TILE_FOUR_WARPS = 512
# Software-pipeline depth of the KV loop. Timed inside the graph-replayed decode step on an
# H200 (bench/results/decode/ab/attention_in_step*.md), two stages beat triton's default of
# three at every shape tried: batch 64 / 1k 1679.6 -> 1672.1 us per step, batch 32 / 32k
# 9329 -> 9264 us, batch 1 / 1k 791.9 -> 790.1 us; four stages were slower at 32k.
NUM_STAGES = 2
# Partials the merging program loads at once, per warp: [query heads of a KV head, splits,
# head dim] fp32. A 2-warp program holds 4096 of them in 64 registers a thread (Llama-3.2-1B:
# 4 x 16 x 64); Qwen3-30B-A3B's 8 heads of 128 would be 256 a thread, more than a thread has,
# so such shapes merge fewer splits per chunk (more with more warps).
MERGE_TILE_ELEMENTS_PER_WARP = 2048
# Chunks the merging program reads one after another at most: the split count is capped at
# this many chunks of `merge_block_s` partials. Qwen3-30B-A3B's shape merges 4 splits a chunk;
# at batch 1 / 8k its 256 splits took 36-43 us and 64 splits 27 us (16: 30 us; at 1k every
# count from 16 up took 14 us; bench/results/decode/attention_decode-20261205T040721Z.md).
# Llama-3.2-1B's merges 16 a chunk, so its cap is MAX_SPLITS.
MAX_MERGE_CHUNKS = 16


@dataclass(frozen=True)
class NewKV:
    """Each sequence's new key and value (before rotary), which the decode kernel rotates
    and writes into the cache itself; the query it is given is unrotated too."""

    key: torch.Tensor  # [T, Hkv, D], may be a strided view of the qkv output
    value: torch.Tensor  # [T, Hkv, D]
    positions: torch.Tensor  # [T]
    cos_sin_cache: torch.Tensor  # [max_pos, D] fp32: cos in the first D/2 columns, sin in the rest
    slot_mapping: torch.Tensor  # [T] int64, -1 = padding (no write)
    is_neox: bool = True
    # the layer's input norm, still to be applied to q, key and value (weight folded into qkv)
    row_norm: DeferredRMSNorm | None = None
    # per-head RMSNorms of q and k before the rotary embedding (Qwen3's q_norm / k_norm)
    head_norms: HeadNorms | None = None


@dataclass(frozen=True)
class HeadNorms:
    """RMSNorm of every query and key head vector over the head dimension, each with its own
    [D] weight, rounded as the unfused norm kernels round (normalised, then scaled)."""

    q_weight: torch.Tensor  # [D]
    k_weight: torch.Tensor  # [D]
    eps: float


@triton.jit
def _rotation(cos_sin_row, dims, HEAD_DIM: tl.constexpr, HALF: tl.constexpr, IS_NEOX: tl.constexpr):
    """One position's rotary angles over the head dims [BLOCK_D] (`cos_sin_row`: cos then sin,
    HALF each; full-width rotary): (partner dims, cos, signed sin), so that a head vector x
    rotates to x * cos + x[partner] * signed_sin."""
    if IS_NEOX:  # pairs (d, d + HALF)
        first = dims < HALF
        partner = tl.where(first, dims + HALF, dims - HALF)
        pair = tl.where(first, dims, dims - HALF)
    else:  # pairs (2i, 2i + 1)
        first = dims % 2 == 0
        partner = dims ^ 1
        pair = dims // 2
    dim_valid = dims < HEAD_DIM
    cos = tl.load(cos_sin_row + pair, mask=dim_valid, other=0.0).to(tl.float32)
    sin = tl.load(cos_sin_row + HALF + pair, mask=dim_valid, other=0.0).to(tl.float32)
    return partner, cos, tl.where(first, -sin, sin)


@triton.jit
def _norm_weights(norm_w_ptr, dims, partner, HEAD_DIM: tl.constexpr, HEAD_NORM: tl.constexpr):
    """A head norm's [D] weight at the head dims and at their rotary partners (HEAD_NORM; else
    placeholders)."""
    weight = tl.zeros(dims.shape, dtype=tl.float32)
    weight_partner = weight
    if HEAD_NORM:
        dim_valid = dims < HEAD_DIM
        weight = tl.load(norm_w_ptr + dims, mask=dim_valid, other=0.0).to(tl.float32)
        weight_partner = tl.load(norm_w_ptr + partner, mask=dim_valid, other=0.0).to(tl.float32)
    return weight, weight_partner


@triton.jit
def _rotated_rows(
    row_ptr, rows, row_stride, rows_valid, dims, partner, cos, signed_sin, norm_w, norm_w_partner, norm_eps,
    HEAD_DIM: tl.constexpr, HEAD_NORM: tl.constexpr,
):
    """[R, BLOCK_D] fp32: head vectors `rows` at `row_ptr` rotated by one position's angles
    (`_rotation`); with HEAD_NORM each vector is RMS-normalised first with the weight
    `norm_w` (`_norm_weights`)."""
    dim_valid = dims < HEAD_DIM
    mask = rows_valid[:, None] & dim_valid[None, :]
    ptrs = row_ptr + rows[:, None].to(tl.int64) * row_stride
    x = tl.load(ptrs + dims[None, :], mask=mask, other=0.0).to(tl.float32)
    y = tl.load(ptrs + partner[None, :], mask=mask, other=0.0).to(tl.float32)
    if HEAD_NORM:  # y is a permutation of x within each row: one inverse RMS for both
        rstd = tl.math.rsqrt(tl.sum(x * x, axis=1) / HEAD_DIM + norm_eps)
        x = _head_normed(x, rstd, norm_w, row_ptr)
        y = _head_normed(y, rstd, norm_w_partner, row_ptr)
    return x * cos[None, :] + y * signed_sin[None, :]


@triton.jit
def _split_range(seq_len, split, window, NUM_SPLITS: tl.constexpr, BLOCK_N: tl.constexpr, SLIDING: tl.constexpr):
    """[start, end) of `split`'s partition of the keys a `seq_len`-token context's last query
    sees (all of them, or the last `window` when SLIDING; may be empty), and how many splits
    cover keys (at least one, so an empty sequence still writes zeros)."""
    first = 0
    if SLIDING:
        first = tl.maximum(seq_len - window, 0)
    num_keys = seq_len - first
    split_len = tl.cdiv(tl.cdiv(num_keys, BLOCK_N), NUM_SPLITS) * BLOCK_N
    start = first + split * split_len
    num_active = tl.maximum(tl.cdiv(num_keys, tl.maximum(split_len, 1)), 1)
    return start, tl.minimum(seq_len, start + split_len), num_active


@triton.jit(do_not_specialize=["stride_table_seq"])
def _paged_decode_split_kernel(
    query_ptr,  # [T, Hq, D]
    cache_ptr,  # [2, num_blocks, block_size, Hkv, D]
    out_ptr,  # [T, Hq, D], written here when NUM_SPLITS == 1
    part_max_ptr,  # [B, Hq, S] fp32
    part_sum_ptr,  # [B, Hq, S] fp32
    part_acc_ptr,  # [B, Hq, S, D] fp32
    counters_ptr,  # [>= B * Hkv] int32, zero between launches
    query_start_loc_ptr,  # [B + 1] int32
    seq_lens_ptr,  # [B] int32
    block_tables_ptr,  # [B, max_blocks_per_seq] int32
    key_ptr,  # ROTARY: [T, Hkv, D] new keys, unrotated
    value_ptr,  # ROTARY: [T, Hkv, D] new values
    positions_ptr,  # ROTARY: [T]
    cos_sin_ptr,  # ROTARY: [max_pos, HEAD_DIM] fp32
    slot_mapping_ptr,  # ROTARY: [T] int64, -1 = padding
    norm_src_ptr,  # ROW_NORM: [T, H] residual rows whose inverse RMS scales q, key and value
    sinks_ptr,  # HAS_SINKS: [Hq] per-head sink logits
    q_norm_w_ptr,  # HEAD_NORM: [D] query head norm weight
    k_norm_w_ptr,  # HEAD_NORM: [D] key head norm weight
    scale_log2,
    stride_q_token,
    stride_q_head,
    stride_cache_kv,
    stride_cache_block,
    stride_cache_slot,
    stride_cache_head,
    stride_table_seq,
    stride_o_token,
    stride_o_head,
    block_size,
    window,  # sliding window in tokens (used when SLIDING)
    stride_k_token,
    stride_k_head,
    stride_v_token,
    stride_v_head,
    stride_cos_sin,
    norm_hidden,
    stride_norm_row,
    norm_eps,
    head_norm_eps,
    QUERIES_PER_KV: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    SLIDING: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_S: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    PREFETCH: tl.constexpr,
    ROTARY: tl.constexpr,
    IS_NEOX: tl.constexpr,
    ROW_NORM: tl.constexpr,
    NORM_BLOCK: tl.constexpr,
    HEADS_FIRST: tl.constexpr,
    PDL: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    HEAD_NORM: tl.constexpr,
):
    if HEADS_FIRST:  # grid (KV heads, splits, sequences): a block's heads are read together
        kv_head = tl.program_id(0)
        split = tl.program_id(1)
        seq = tl.program_id(2)
        num_kv_heads = tl.num_programs(0)
    else:  # grid (splits, sequences, KV heads)
        split = tl.program_id(0)
        seq = tl.program_id(1)
        kv_head = tl.program_id(2)
        num_kv_heads = tl.num_programs(2)

    # Sequence lengths, block tables and every cached position but the newest are written
    # before the previous kernel runs, so with PREFETCH (short partitions, where the load
    # latency is most of a program's time) the first tile is loaded before waiting on it.
    seq_len = tl.load(seq_lens_ptr + seq)
    part_start, part_end, num_active = _split_range(seq_len, split, window, NUM_SPLITS, BLOCK_N, SLIDING)
    q_token = tl.load(query_start_loc_ptr + seq)
    if tl.load(query_start_loc_ptr + seq + 1) == q_token:
        return
    if NUM_SPLITS > 1 and split >= num_active:
        return

    group = tl.arange(0, BLOCK_G)  # [BLOCK_G] query heads of this KV head
    dims = tl.arange(0, BLOCK_D)
    group_valid = group < QUERIES_PER_KV
    dim_valid = dims < HEAD_DIM
    q_heads = kv_head * QUERIES_PER_KV + group
    table_row = block_tables_ptr + seq.to(tl.int64) * stride_table_seq
    if PREFETCH:
        k_ptrs, v_ptrs, key_valid, kv_mask = kv_tile_pointers(
            cache_ptr, table_row, part_start, part_end, kv_head, dims, dim_valid, block_size,
            stride_cache_kv, stride_cache_block, stride_cache_slot, stride_cache_head, BLOCK_N,
        )
        k, v = load_kv_tile(k_ptrs, v_ptrs, kv_mask, DOT_DTYPE)  # [BLOCK_N, BLOCK_D]
    if ROTARY:  # positions and slots are written with the sequence lengths: their loads go first too
        half: tl.constexpr = HEAD_DIM // 2
        q_token64 = q_token.to(tl.int64)
        cos_sin_row = cos_sin_ptr + tl.load(positions_ptr + q_token64).to(tl.int64) * stride_cos_sin
        partner, cos, signed_sin = _rotation(cos_sin_row, dims, HEAD_DIM, half, IS_NEOX)
        q_norm_w, q_norm_w_partner = _norm_weights(q_norm_w_ptr, dims, partner, HEAD_DIM, HEAD_NORM)
        k_norm_w, k_norm_w_partner = _norm_weights(k_norm_w_ptr, dims, partner, HEAD_DIM, HEAD_NORM)
        slot = tl.load(slot_mapping_ptr + q_token64).to(tl.int64)
    wait_for_producer(PDL)
    release_dependents(PDL)

    if ROTARY:
        rstd = 1.0
        if ROW_NORM:
            rstd = row_inverse_rms(norm_src_ptr + q_token64 * stride_norm_row, norm_hidden, norm_eps, NORM_BLOCK)
        q = _rotated_rows(
            query_ptr + q_token64 * stride_q_token, q_heads, stride_q_head, group_valid, dims, partner, cos,
            signed_sin, q_norm_w, q_norm_w_partner, head_norm_eps, HEAD_DIM, HEAD_NORM,
        )
        if ROW_NORM:
            q = q * rstd
        q = q.to(query_ptr.dtype.element_ty).to(DOT_DTYPE)  # rounded as a rotated query in memory would be
        # The new key and value (loaded beside the query, so no program waits on them later);
        # only the last split, whose partition holds the newest position, writes them.
        head = kv_head + tl.arange(0, 1)  # [1]
        one = head == kv_head
        key = _rotated_rows(key_ptr + q_token64 * stride_k_token, head, stride_k_head, one, dims, partner, cos,
                            signed_sin, k_norm_w, k_norm_w_partner, head_norm_eps, HEAD_DIM, HEAD_NORM)
        value = tl.load(value_ptr + q_token64 * stride_v_token + head[:, None] * stride_v_head + dims[None, :],
                        mask=one[:, None] & dim_valid[None, :])
        if ROW_NORM:
            key = key * rstd
            value = value.to(tl.float32) * rstd
        # rounded to the activations' dtype first, as the unfused rotary + KV write stores them
        key = to_cache(key.to(key_ptr.dtype.element_ty), cache_ptr)  # [1, BLOCK_D]
        value = to_cache(value.to(value_ptr.dtype.element_ty), cache_ptr)
        if (split == num_active - 1) & (slot >= 0):
            slot_ptr = cache_ptr + (slot // block_size) * stride_cache_block + (slot % block_size) * stride_cache_slot
            dst = slot_ptr + head[:, None] * stride_cache_head + dims[None, :]
            tl.store(dst, key, mask=one[:, None] & dim_valid[None, :])
            tl.store(dst + stride_cache_kv, value, mask=one[:, None] & dim_valid[None, :])
        tl.debug_barrier()  # the whole program sees the written slot in the tiles it loads from here on
    else:
        q = tl.load(
            query_ptr + q_token.to(tl.int64) * stride_q_token + q_heads[:, None] * stride_q_head + dims[None, :],
            mask=group_valid[:, None] & dim_valid[None, :],
            other=0.0,
        ).to(DOT_DTYPE)  # [BLOCK_G, BLOCK_D]
    m_i = tl.full([BLOCK_G], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    loop_start = part_start
    if PREFETCH:
        # The prefetched tile may predate the newest position's K/V: with ROTARY this program
        # holds them in registers, else the previous kernel wrote them and they are reloaded.
        newest = (part_start + tl.arange(0, BLOCK_N) == seq_len - 1)[:, None] & kv_mask
        if ROTARY:
            k = tl.where(newest & (slot >= 0), key.to(DOT_DTYPE), k)
            v = tl.where(newest & (slot >= 0), value.to(DOT_DTYPE), v)
        else:
            newest_k, newest_v = load_kv_tile(k_ptrs, v_ptrs, newest, DOT_DTYPE)
            k = tl.where(newest, newest_k, k)
            v = tl.where(newest, newest_v, v)
        if part_start < part_end:
            m_i, l_i, acc = attend_tile(q, k, v, key_valid[None, :], m_i, l_i, acc, scale_log2, DOT_DTYPE, DOT_PRECISION)
        loop_start = part_start + BLOCK_N
    for start in range(loop_start, part_end, BLOCK_N):
        k_ptrs, v_ptrs, key_valid, kv_mask = kv_tile_pointers(
            cache_ptr, table_row, start, part_end, kv_head, dims, dim_valid, block_size,
            stride_cache_kv, stride_cache_block, stride_cache_slot, stride_cache_head, BLOCK_N,
        )
        k, v = load_kv_tile(k_ptrs, v_ptrs, kv_mask, DOT_DTYPE)
        m_i, l_i, acc = attend_tile(q, k, v, key_valid[None, :], m_i, l_i, acc, scale_log2, DOT_DTYPE, DOT_PRECISION)

    # One split, or one that covers the whole context (a short one): normalise and write here.
    alone = True
    if NUM_SPLITS > 1:
        alone = num_active == 1
    if alone:
        _store_output(out_ptr, sinks_ptr, q_token, q_heads, group_valid, dims, dim_valid, m_i, l_i, acc,
                      stride_o_token, stride_o_head, HAS_SINKS)
    else:
        num_q_heads = QUERIES_PER_KV * num_kv_heads
        part_row = (seq.to(tl.int64) * num_q_heads + q_heads) * NUM_SPLITS + split  # [BLOCK_G]
        tl.store(part_max_ptr + part_row, m_i, mask=group_valid)
        tl.store(part_sum_ptr + part_row, l_i, mask=group_valid)
        tl.store(
            part_acc_ptr + part_row[:, None] * HEAD_DIM + dims[None, :],
            acc,
            mask=group_valid[:, None] & dim_valid[None, :],
        )
        # Every thread's partials are written before the counter moves (release); the split
        # that moves it last sees them all (acquire) and merges.
        tl.debug_barrier()
        counter = counters_ptr + seq * num_kv_heads + kv_head
        finished = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
        if finished == num_active - 1:
            tl.debug_barrier()
            _merge_splits(
                out_ptr, part_max_ptr, part_sum_ptr, part_acc_ptr, sinks_ptr, q_token, seq, kv_head, num_q_heads,
                num_active, stride_o_token, stride_o_head, QUERIES_PER_KV, HEAD_DIM, NUM_SPLITS, BLOCK_Q, BLOCK_S,
                BLOCK_D, HAS_SINKS,
            )
            # Every split of this (sequence, KV head) has counted itself, so nothing else touches
            # the counter in this launch, and the launch boundary orders the reset before the
            # next launch's atomics: a plain store, not a fenced atomic on the program's way out.
            tl.store(counter, 0)


@triton.jit
def _store_output(out_ptr, sinks_ptr, q_token, q_heads, group_valid, dims, dim_valid, m_i, l_i, acc, stride_o_token,
                  stride_o_head, HAS_SINKS: tl.constexpr):
    """out[q_token, q_heads] = acc / l (with the heads' sink logits first, HAS_SINKS)."""
    if HAS_SINKS:
        m_i, l_i, acc = add_sinks(sinks_ptr, q_heads, group_valid, m_i, l_i, acc)
    # A padding sequence (seq_len 0) ran no tile: write zeros, not 0/0.
    out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    tl.store(
        out_ptr + q_token.to(tl.int64) * stride_o_token + q_heads[:, None] * stride_o_head + dims[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=group_valid[:, None] & dim_valid[None, :],
    )


@triton.jit
def _load_partials(part_max_ptr, part_sum_ptr, part_acc_ptr, row0, group_valid, dims, dim_valid, chunk, num_active,
                   HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr):
    """The partials (max [BLOCK_Q, BLOCK_S], sum, accumulator [BLOCK_Q, BLOCK_S, BLOCK_D]) of
    splits chunk .. chunk + BLOCK_S - 1 below `num_active` (neutral values past it), read
    past L1: other programs wrote them."""
    splits = chunk + tl.arange(0, BLOCK_S)  # [BLOCK_S]
    valid = group_valid[:, None] & (splits < num_active)[None, :]  # [BLOCK_Q, BLOCK_S]
    rows = row0[:, None] + splits[None, :]  # [BLOCK_Q, BLOCK_S]
    part_max = tl.load(part_max_ptr + rows, mask=valid, other=-1.0e30, cache_modifier=".cg")
    part_sum = tl.load(part_sum_ptr + rows, mask=valid, other=0.0, cache_modifier=".cg")
    part_acc = tl.load(
        part_acc_ptr + rows[:, :, None] * HEAD_DIM + dims[None, None, :],
        mask=valid[:, :, None] & dim_valid[None, None, :],
        other=0.0,
        cache_modifier=".cg",
    )
    return part_max, part_sum, part_acc


@triton.jit
def _merge_splits(
    out_ptr,  # [T, Hq, D]
    part_max_ptr,  # [B, Hq, S] fp32
    part_sum_ptr,  # [B, Hq, S] fp32
    part_acc_ptr,  # [B, Hq, S, D] fp32
    sinks_ptr,  # HAS_SINKS: [Hq]
    q_token,
    seq,
    kv_head,
    num_q_heads,
    num_active,
    stride_o_token,
    stride_o_head,
    QUERIES_PER_KV: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HAS_SINKS: tl.constexpr,
):
    """Merge the first `num_active` splits' partials of one KV head's query heads into `out`."""
    group = tl.arange(0, BLOCK_Q)  # [BLOCK_Q]
    group_valid = group < QUERIES_PER_KV
    q_heads = kv_head * QUERIES_PER_KV + group
    dims = tl.arange(0, BLOCK_D)
    dim_valid = dims < HEAD_DIM
    row0 = (seq.to(tl.int64) * num_q_heads + q_heads) * NUM_SPLITS  # [BLOCK_Q]
    total_max = tl.full([BLOCK_Q], -1.0e30, dtype=tl.float32)
    total_sum = tl.zeros([BLOCK_Q], dtype=tl.float32)
    total_acc = tl.zeros([BLOCK_Q, BLOCK_D], dtype=tl.float32)
    # Each chunk's loads go out before the previous chunk is reduced: two chunks take one
    # round trip to L2, not two (Qwen3-30B-A3B's shape merges 16 splits at 1k in two chunks).
    part_max, part_sum, part_acc = _load_partials(part_max_ptr, part_sum_ptr, part_acc_ptr, row0, group_valid, dims,
                                                  dim_valid, 0, num_active, HEAD_DIM, BLOCK_S)
    for chunk in range(0, num_active, BLOCK_S):
        next_max, next_sum, next_acc = _load_partials(part_max_ptr, part_sum_ptr, part_acc_ptr, row0, group_valid,
                                                      dims, dim_valid, chunk + BLOCK_S, num_active, HEAD_DIM, BLOCK_S)
        new_max = tl.maximum(total_max, tl.max(part_max, axis=1))  # [BLOCK_Q]
        weights = tl.exp2(part_max - new_max[:, None])  # [BLOCK_Q, BLOCK_S]
        rescale = tl.exp2(total_max - new_max)  # [BLOCK_Q]
        total_sum = total_sum * rescale + tl.sum(part_sum * weights, axis=1)
        total_acc = total_acc * rescale[:, None] + tl.sum(part_acc * weights[:, :, None], axis=1)
        total_max = new_max
        part_max, part_sum, part_acc = next_max, next_sum, next_acc
    _store_output(out_ptr, sinks_ptr, q_token, q_heads, group_valid, dims, dim_valid, total_max, total_sum, total_acc,
                  stride_o_token, stride_o_head, HAS_SINKS)


_decode_launcher = CachedLauncher(_paged_decode_split_kernel)


def decode_num_warps(head_dim: int, num_seqs: int, queries_per_kv: int) -> int:
    """Warps of a decode program for `queries_per_kv` query heads `head_dim` wide in a launch
    over `num_seqs` sequences (see WIDE_HEAD_DIM)."""
    wide = head_dim >= WIDE_HEAD_DIM
    if num_seqs == 1:
        if wide:
            return WIDE_HEAD_ONE_SEQUENCE_WARPS
        if queries_per_kv * head_dim >= GROUP_TILE_FOUR_WARPS:
            return 4
    return 4 if wide else 2


def merge_block_s(queries_per_kv: int, block_d: int, num_splits: int, num_warps: int = 2) -> int:
    """Splits the merging program reads per chunk: up to 16, fewer where the chunk's partials
    would exceed MERGE_TILE_ELEMENTS_PER_WARP a warp (a power of two)."""
    per_split = triton.next_power_of_2(queries_per_kv) * block_d
    return max(1, min(16, num_splits, MERGE_TILE_ELEMENTS_PER_WARP * num_warps // per_split))


def choose_num_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int, block_n: int = 64,
                      merge_chunk: int = 16) -> int:
    """Splits per sequence: a power of two that brings the grid to about TARGET_PROGRAMS.

    Depends only on host ints (under CUDA graphs: the bucket size and the capacity); never
    more splits than `block_n`-token tiles in `max_seq_len`, nor than MAX_MERGE_CHUNKS chunks
    of `merge_chunk` (`merge_block_s`) partials for the merging program to read.
    """
    wanted = triton.next_power_of_2(triton.cdiv(TARGET_PROGRAMS, max(1, num_seqs * num_kv_heads)))
    tiles = triton.cdiv(max(max_seq_len, 1), block_n)
    return max(1, min(wanted, MAX_SPLITS, MAX_MERGE_CHUNKS * merge_chunk, triton.next_power_of_2(tiles)))


def paged_decode_attention(
    query: torch.Tensor,  # [T, Hq, D], one token per sequence
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, Hkv, D]
    metadata: AttentionMetadata,
    scale: float,
    num_splits: int | None = None,
    block_n: int = 64,
    num_warps: int | None = None,
    num_stages: int | None = NUM_STAGES,
    sliding_window: int | None = None,
    pdl: bool = True,
    new_kv: NewKV | None = None,
    prefetch: bool | None = None,
    heads_first: bool | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:  # [T, Hq, D]
    """Split-KV decode attention: every sequence's single new token over its paged context
    (its last `sliding_window` positions only, when given), with programmatic dependent
    launch where the device has it and `pdl`. `sinks` [Hq]: one extra softmax logit per
    query head with no value (gpt-oss), folded in where the output is normalised.

    `num_splits` (a power of two) defaults to `choose_num_splits`; `block_n` is the KV tile;
    `num_warps` defaults to `decode_num_warps` of the heads and batch;
    `num_stages` None leaves the pipeline depth to triton. With `new_kv` the query and the new
    key are unrotated: the kernel applies the rotary embedding (full head width) and writes
    the new key and value into their slots first.

    `prefetch` (None: from `num_splits`, see PREFETCH_MIN_SPLITS) loads each program's first
    KV tile before the PDL wait; `heads_first` (None: from the number of sequences, see
    HEADS_FIRST_MIN_SEQS) orders the grid KV head fastest, so the
    programs reading one block's heads run side by side.
    """
    num_tokens, num_q_heads, head_dim = query.shape
    num_kv_heads = kv_cache.shape[3]
    if num_q_heads % num_kv_heads:
        raise ValueError(f"{num_q_heads} query heads are not a multiple of {num_kv_heads} KV heads")
    if query.stride(-1) != 1 or kv_cache.stride(-1) != 1:
        raise ValueError("paged attention needs the head dimension contiguous in query and kv_cache")
    num_seqs = metadata.num_seqs
    if num_warps is None:
        num_warps = decode_num_warps(head_dim, num_seqs, num_q_heads // num_kv_heads)
    if num_splits is None:
        visible = min(metadata.max_seq_len, sliding_window) if sliding_window else metadata.max_seq_len
        merge_chunk = merge_block_s(num_q_heads // num_kv_heads, triton.next_power_of_2(head_dim), MAX_SPLITS,
                                    num_warps)
        num_splits = choose_num_splits(num_seqs, num_kv_heads, visible, block_n, merge_chunk)
    if num_splits < 1 or num_splits & (num_splits - 1):
        raise ValueError(f"num_splits must be a power of two, got {num_splits}")
    dot_dtype, precision = dot_settings(query)
    rotary = new_kv is not None
    if new_kv is None:
        new_kv = NewKV(query, query, metadata.seq_lens, query, metadata.seq_lens)  # unread placeholders
    elif new_kv.cos_sin_cache.shape[-1] != head_dim or head_dim % 2:
        raise ValueError(
            f"fused decode rotary needs an even, full-width rotary dim: cos_sin_cache has "
            f"{new_kv.cos_sin_cache.shape[-1]} columns for head_dim {head_dim}"
        )
    elif new_kv.key.stride(-1) != 1 or new_kv.value.stride(-1) != 1:
        raise ValueError("new_kv key and value need the head dimension contiguous")
    norm = row_norm_args(new_kv.row_norm if rotary else None, num_tokens, query, "new_kv.row_norm")
    head_norms = new_kv.head_norms if rotary else None
    if head_norms is not None:
        if new_kv.row_norm is not None:
            raise ValueError("new_kv takes a deferred row norm or head norms, not both")
        for name, weight in (("q_weight", head_norms.q_weight), ("k_weight", head_norms.k_weight)):
            if weight.shape != (head_dim,) or weight.stride(-1) != 1:
                raise ValueError(f"new_kv.head_norms.{name} must be [{head_dim}] and contiguous, "
                                 f"got {tuple(weight.shape)}")
    out = torch.empty_like(query)
    if num_tokens == 0 or num_seqs == 0:
        return out
    if num_splits == 1:  # the split kernel writes `out` itself; partials and counters are unused
        part_max = part_sum = part_acc = torch.empty(0, dtype=torch.float32, device=query.device)
        counters = metadata.seq_lens
    else:
        counters = metadata.split_counters
        if counters is None or counters.numel() < num_seqs * num_kv_heads:
            counters = torch.zeros(num_seqs * num_kv_heads, dtype=torch.int32, device=query.device)
        part_max = torch.empty((num_seqs, num_q_heads, num_splits), dtype=torch.float32, device=query.device)
        part_sum = torch.empty_like(part_max)
        part_acc = torch.empty((num_seqs, num_q_heads, num_splits, head_dim), dtype=torch.float32, device=query.device)
    queries_per_kv = num_q_heads // num_kv_heads
    block_d = max(16, triton.next_power_of_2(head_dim))
    pdl = pdl_enabled(query, pdl)
    launch = launch_options(pdl)
    if num_stages is not None:
        launch["num_stages"] = num_stages
    if prefetch is None:
        prefetch = num_splits >= PREFETCH_MIN_SPLITS
    if heads_first is None:
        heads_first = num_seqs >= HEADS_FIRST_MIN_SEQS
    grid = (num_kv_heads, num_splits, num_seqs) if heads_first else (num_splits, num_seqs, num_kv_heads)
    _decode_launcher(
        grid,
        (query, kv_cache, out, part_max, part_sum, part_acc, counters,
         metadata.query_start_loc, metadata.seq_lens, metadata.block_tables,
         new_kv.key, new_kv.value, new_kv.positions, new_kv.cos_sin_cache, new_kv.slot_mapping, norm.source,
         sinks if sinks is not None else query,
         head_norms.q_weight if head_norms is not None else query,
         head_norms.k_weight if head_norms is not None else query,
         scale * LOG2E, query.stride(0), query.stride(1),
         kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
         metadata.block_tables.stride(0), out.stride(0), out.stride(1), kv_cache.shape[2], sliding_window or 0,
         new_kv.key.stride(0), new_kv.key.stride(1), new_kv.value.stride(0), new_kv.value.stride(1),
         new_kv.cos_sin_cache.stride(0), *norm.scalars, head_norms.eps if head_norms is not None else 0.0),
        (queries_per_kv, head_dim, num_splits, bool(sliding_window), max(16, triton.next_power_of_2(queries_per_kv)),
         block_n, block_d, triton.next_power_of_2(queries_per_kv), merge_block_s(queries_per_kv, block_d, num_splits, num_warps),
         dot_dtype, precision,
         prefetch, rotary, new_kv.is_neox, norm.enabled, norm.block,
         heads_first, pdl, sinks is not None, head_norms is not None),
        num_warps, **launch,
    )
    return out
