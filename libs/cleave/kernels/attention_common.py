"""Settings and tile helpers shared by the paged attention kernels."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634

_TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


def dot_settings(query: torch.Tensor) -> tuple[tl.dtype, str]:
    """(operand dtype, input precision) for the kernels' `tl.dot` calls.

    On a GPU the operands stay in the activations' dtype (exact fp32 products for fp32).
    Off the GPU the kernels run in the Triton interpreter, whose half-precision `tl.dot`
    is unreliable, so operands are widened to fp32 there.
    """
    if query.dtype not in _TL_DTYPES:
        raise ValueError(f"the kernels support fp32, bf16 and fp16 activations, got {query.dtype}")
    if not query.is_cuda:
        return tl.float32, "ieee"
    return _TL_DTYPES[query.dtype], "ieee" if query.dtype == torch.float32 else "tf32"


@triton.jit
def kv_tile_pointers(
    cache_ptr, table_row, start, end, kv_head, dims, dim_valid, block_size,
    stride_cache_kv, stride_cache_block, stride_cache_slot, stride_cache_head, BLOCK_N: tl.constexpr,
):
    """K and V pointers [BLOCK_N, BLOCK_D] of the cached positions [start, start + BLOCK_N)
    (masked to < end) of one KV head, through the sequence's block table."""
    keys_pos = start + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    key_valid = keys_pos < end
    block_ids = tl.load(table_row + keys_pos // block_size, mask=key_valid, other=0).to(tl.int64)
    slot_base = block_ids * stride_cache_block + (keys_pos % block_size) * stride_cache_slot + kv_head * stride_cache_head
    k_ptrs = cache_ptr + slot_base[:, None] + dims[None, :]
    return k_ptrs, k_ptrs + stride_cache_kv, key_valid, key_valid[:, None] & dim_valid[None, :]


@triton.jit
def load_kv_tile(k_ptrs, v_ptrs, kv_mask, DOT_DTYPE: tl.constexpr):
    """K and V [BLOCK_N, BLOCK_D] at `k_ptrs` / `v_ptrs` (zeros where masked off), upcast from
    the cache's element type (the model's, or float8 e4m3: `cleave.kernels.kv_cache_dtype`)
    to the dot's operand dtype; every read of the cache goes through here."""
    k = tl.load(k_ptrs, mask=kv_mask, other=0.0).to(DOT_DTYPE)
    v = tl.load(v_ptrs, mask=kv_mask, other=0.0).to(DOT_DTYPE)
    return k, v


@triton.jit
def attend_tile(q, k, v, visible, m_i, l_i, acc, scale_log2, DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr,
                MASKED: tl.constexpr = True):
    """Online-softmax update of (running max, sum, accumulator) [M], [M], [M, D] with one K/V
    tile [N, D] (`load_kv_tile`'s, in DOT_DTYPE) for queries q [M, D]; `visible` ([M, N] or
    [1, N]) masks the scores, unless MASKED is off (every row sees every key of the tile;
    `visible` is not read)."""
    scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2  # [M, N]
    if MASKED:
        scores = tl.where(visible, scores, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(scores, axis=1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(scores - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None]
    acc = tl.dot(p.to(DOT_DTYPE), v, acc, input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def add_sinks(sinks_ptr, heads, head_valid, m_i, l_i, acc):
    """Fold one learned logit per query head (attention sinks, gpt-oss) into the softmax:
    it joins the denominator and contributes no value. (m, l, acc) [M], [M], [M, D] in the
    log2 domain of `attend_tile`; the sink is in natural-log units, unscaled."""
    sink = tl.load(sinks_ptr + heads, mask=head_valid, other=float("-inf")).to(tl.float32) * 1.4426950408889634
    m_new = tl.maximum(m_i, sink)
    alpha = tl.exp2(m_i - m_new)
    return m_new, l_i * alpha + tl.exp2(sink - m_new), acc * alpha[:, None]
