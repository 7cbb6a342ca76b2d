"""Triton KV write: scatter each new token's K and V into its paged-cache slot.

One program per token copies all of its `[Hkv, D]` K and V rows; a token whose slot is
PAD_SLOT_ID (-1) is padding (CUDA-graph batches padded up to a bucket) and writes nothing.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from cleave.kernels.dispatch import CachedLauncher
from cleave.kernels.kv_cache_dtype import to_cache


@triton.jit
def _write_kv_kernel(
    key_ptr,  # [T, Hkv, D]
    value_ptr,  # [T, Hkv, D]
    cache_ptr,  # [2, num_blocks, block_size, Hkv, D]
    slot_mapping_ptr,  # [T] int64
    stride_key_token,
    stride_key_head,
    stride_value_token,
    stride_value_head,
    stride_cache_kv,
    stride_cache_block,
    stride_cache_slot,
    stride_cache_head,
    block_size,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return
    block_id = slot // block_size
    block_offset = slot % block_size
    heads = tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_D)
    mask = (heads[:, None] < NUM_KV_HEADS) & (dims[None, :] < HEAD_DIM)  # [BLOCK_H, BLOCK_D]
    token64 = token.to(tl.int64)
    key = tl.load(
        key_ptr + token64 * stride_key_token + heads[:, None] * stride_key_head + dims[None, :],
        mask=mask,
    )
    value = tl.load(
        value_ptr + token64 * stride_value_token + heads[:, None] * stride_value_head + dims[None, :],
        mask=mask,
    )
    dst = (
        cache_ptr
        + block_id * stride_cache_block
        + block_offset * stride_cache_slot
        + heads[:, None] * stride_cache_head
        + dims[None, :]
    )
    tl.store(dst, to_cache(key, cache_ptr), mask=mask)
    tl.store(dst + stride_cache_kv, to_cache(value, cache_ptr), mask=mask)


_launcher = CachedLauncher(_write_kv_kernel)


def write_kv_triton(
    key: torch.Tensor,  # [T, Hkv, D]
    value: torch.Tensor,  # [T, Hkv, D]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, Hkv, D]
    slot_mapping: torch.Tensor,  # [T] int64, -1 = padding
) -> None:
    """Write new K/V into the paged cache with one Triton launch (no host syncs)."""
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    if key.stride(-1) != 1 or value.stride(-1) != 1 or kv_cache.stride(-1) != 1:
        raise ValueError("write_kv needs the head dimension contiguous in key, value and kv_cache")
    _launcher(
        (num_tokens,),
        (key, value, kv_cache, slot_mapping,
         key.stride(0), key.stride(1), value.stride(0), value.stride(1),
         kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3), kv_cache.shape[2]),
        (num_kv_heads, head_dim, triton.next_power_of_2(num_kv_heads), triton.next_power_of_2(head_dim)),
        4,
    )
