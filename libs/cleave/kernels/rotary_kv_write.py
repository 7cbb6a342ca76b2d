"""Rotary embedding fused with the KV-cache write: one launch per layer instead of two.

Per token, one program rotates every q head in place and a second rotates every k head
straight into the token's cache slot (k itself is left as it was: nothing reads it after the
write) and copies v beside it; a padding token (slot -1) still rotates q but writes no K/V. Columns
past `rotary_dim` (partial rotary) are copied unrotated. Semantically this is
`apply_rotary(q, k, ...)` followed by `write_kv(k, v, ...)`, which is the reference. With
`head_norms` (Qwen3's per-head q/k RMSNorms; the rotary must span the whole head) each head is
normalised first, in the same pass: no separate norm launches, and no copies of q and k to
lay their heads out as rows for them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from cleave.kernels.attention import write_kv_reference
from cleave.kernels.attention_decode import HeadNorms
from cleave.kernels.dispatch import CachedLauncher, Impl, use_triton
from cleave.kernels.kv_cache_dtype import to_cache
from cleave.kernels.pdl import launch_options, pdl_enabled, release_dependents, wait_for_producer
from cleave.kernels.rms_norm import rms_norm_reference
from cleave.kernels.rotary import _rotate_heads, apply_rotary_reference


@triton.jit
def _copy_heads(src_ptr, src_head_stride, dst_ptr, dst_head_stride, num_heads, first_col, num_cols,
                HEADS: tl.constexpr, BLOCK_D: tl.constexpr):
    heads = tl.arange(0, HEADS)
    cols = first_col + tl.arange(0, BLOCK_D)
    mask = (heads[:, None] < num_heads) & (cols[None, :] < num_cols)  # [HEADS, BLOCK_D]
    rows = heads[:, None].to(tl.int64)
    values = tl.load(src_ptr + rows * src_head_stride + cols[None, :], mask=mask)
    tl.store(dst_ptr + rows * dst_head_stride + cols[None, :], to_cache(values, dst_ptr), mask=mask)


@triton.jit
def _rotary_kv_write_kernel(
    q_ptr,  # [T, Hq, D] strided
    k_ptr,  # [T, Hkv, D] strided
    v_ptr,  # [T, Hkv, D] strided
    positions_ptr,  # [T]
    cos_sin_ptr,  # [max_pos, 2 * HALF]
    cache_ptr,  # [2, num_blocks, block_size, Hkv, D]
    slot_mapping_ptr,  # [T] int64, -1 = padding
    q_norm_w_ptr,  # HEAD_NORM: [D]
    k_norm_w_ptr,  # HEAD_NORM: [D]
    num_q_heads,
    num_kv_heads,
    head_dim,
    q_token_stride,
    q_head_stride,
    k_token_stride,
    k_head_stride,
    v_token_stride,
    v_head_stride,
    cos_sin_row_stride,
    stride_cache_kv,
    stride_cache_block,
    stride_cache_slot,
    stride_cache_head,
    block_size,
    norm_eps,
    HALF: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    Q_HEADS: tl.constexpr,
    KV_HEADS: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PARTIAL: tl.constexpr,
    IS_NEOX: tl.constexpr,
    HEAD_NORM: tl.constexpr,
    PDL: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)  # 0: q, 1: k and v
    wait_for_producer(PDL)
    release_dependents(PDL)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if (part == 1) & (slot < 0):
        return
    position = tl.load(positions_ptr + token).to(tl.int64)
    dims = tl.arange(0, BLOCK_HALF)
    cos_sin_row = cos_sin_ptr + position * cos_sin_row_stride
    cos = tl.load(cos_sin_row + dims, mask=dims < HALF, other=0.0).to(tl.float32)
    sin = tl.load(cos_sin_row + HALF + dims, mask=dims < HALF, other=0.0).to(tl.float32)

    if part == 0:
        q_row = q_ptr + token * q_token_stride
        _rotate_heads(q_row, q_head_stride, q_row, q_head_stride, 0, num_q_heads, cos, sin,
                      HALF, BLOCK_HALF, Q_HEADS, IS_NEOX, q_norm_w_ptr, norm_eps, HEAD_NORM)
    else:
        k_row = k_ptr + token * k_token_stride
        key_dst = cache_ptr + (slot // block_size) * stride_cache_block + (slot % block_size) * stride_cache_slot
        _rotate_heads(k_row, k_head_stride, key_dst, stride_cache_head, 0, num_kv_heads, cos, sin,
                      HALF, BLOCK_HALF, KV_HEADS, IS_NEOX, k_norm_w_ptr, norm_eps, HEAD_NORM)
        if PARTIAL:
            _copy_heads(k_row, k_head_stride, key_dst, stride_cache_head, num_kv_heads, 2 * HALF, head_dim,
                        KV_HEADS, BLOCK_D)
        _copy_heads(v_ptr + token * v_token_stride, v_head_stride, key_dst + stride_cache_kv, stride_cache_head,
                    num_kv_heads, 0, head_dim, KV_HEADS, BLOCK_D)


_launcher = CachedLauncher(_rotary_kv_write_kernel)


def rotary_write_kv_reference(query, key, value, positions, cos_sin_cache, kv_cache, slot_mapping, is_neox=True,
                              head_norms: HeadNorms | None = None):
    """The head norms, apply_rotary, then write_kv (q and k are normalised and rotated in place
    here; the kernel leaves k)."""
    if head_norms is not None:
        for x, weight in ((query, head_norms.q_weight), (key, head_norms.k_weight)):
            x.copy_(rms_norm_reference(x.reshape(-1, x.shape[-1]), weight, head_norms.eps).view(x.shape))
    apply_rotary_reference(query, key, positions, cos_sin_cache, is_neox)
    write_kv_reference(key, value, kv_cache, slot_mapping)


def rotary_write_kv(
    query: torch.Tensor,  # [T, Hq, D], rotated in place
    key: torch.Tensor,  # [T, Hkv, D]
    value: torch.Tensor,  # [T, Hkv, D]
    positions: torch.Tensor,  # [T]
    cos_sin_cache: torch.Tensor,  # [max_pos, R]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, Hkv, D]
    slot_mapping: torch.Tensor,  # [T] int64, -1 = padding
    is_neox: bool = True,
    impl: Impl = "auto",
    pdl: bool = True,
    head_norms: HeadNorms | None = None,
) -> None:
    """Rotate q in place and write rotated k and v into their cache slots (with programmatic
    dependent launch where the device has it and `pdl`); with `head_norms`, q and k heads are
    RMS-normalised before their rotation (q in place too)."""
    if head_norms is not None and cos_sin_cache.shape[-1] != query.shape[-1]:
        raise ValueError("head norms inside the rotary need the rotary over the whole head")
    if not use_triton(query, impl):
        rotary_write_kv_reference(query, key, value, positions, cos_sin_cache, kv_cache, slot_mapping, is_neox,
                                  head_norms)
        return
    num_tokens, num_q_heads, head_dim = query.shape
    num_kv_heads = key.shape[1]
    rotary_dim = cos_sin_cache.shape[-1]
    if rotary_dim > head_dim or rotary_dim % 2:
        raise ValueError(f"need an even rotary_dim <= head_dim, got {rotary_dim} vs {head_dim}")
    if any(t.stride(-1) != 1 for t in (query, key, value, kv_cache)):
        raise ValueError("q, k, v and kv_cache need unit stride along head_dim")
    if num_tokens == 0:
        return
    half = rotary_dim // 2
    pdl = pdl_enabled(query, pdl)
    _launcher(
        (num_tokens, 2),  # axis 1: 0 rotates q, 1 writes k and v
        (
            query, key, value, positions, cos_sin_cache, kv_cache, slot_mapping,
            head_norms.q_weight if head_norms is not None else query,
            head_norms.k_weight if head_norms is not None else query,
            num_q_heads, num_kv_heads, head_dim,
            query.stride(0), query.stride(1), key.stride(0), key.stride(1), value.stride(0), value.stride(1),
            cos_sin_cache.stride(0),
            kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
            kv_cache.shape[2],
            head_norms.eps if head_norms is not None else 0.0,
        ),
        (
            half,
            triton.next_power_of_2(half),
            triton.next_power_of_2(num_q_heads),
            triton.next_power_of_2(num_kv_heads),
            triton.next_power_of_2(head_dim),
            rotary_dim < head_dim,
            is_neox,
            head_norms is not None,
            pdl,
        ),
        4,
        **launch_options(pdl),
    )
