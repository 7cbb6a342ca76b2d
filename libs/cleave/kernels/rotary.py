"""Rotary position embedding applied in place to q and k (NeoX and GPT-J layouts).

cos_sin_cache: [max_position, rotary_dim] with cos in the first rotary_dim/2 columns and sin
in the rest; rope-scaling variants only change how the cache is built.

The Triton kernel runs one program per (token, block of heads); q heads come first on grid
axis 1, then k heads, so q and k rotate in one launch. Heads are addressed through their
token and head strides, so q and k may be views into a fused qkv projection output. Only the
first rotary_dim columns of each head are read and written (partial rotary).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from cleave.kernels.dispatch import CachedLauncher, Impl, use_triton
from cleave.kernels.kv_cache_dtype import to_cache

_TILE_ELEMENTS = 2048  # q/k elements one program rotates


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, is_neox: bool) -> torch.Tensor:
    # x: [T, H, R], cos/sin: [T, 1, R/2]
    if is_neox:
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)


def apply_rotary_reference(
    query: torch.Tensor,  # [T, Hq, D]
    key: torch.Tensor,  # [T, Hkv, D]
    positions: torch.Tensor,  # [T]
    cos_sin_cache: torch.Tensor,  # [max_pos, R]
    is_neox: bool = True,
) -> None:
    rotary_dim = cos_sin_cache.shape[-1]
    cos, sin = cos_sin_cache[positions.long()].float().unsqueeze(1).chunk(2, dim=-1)
    for tensor in (query, key):
        rot = tensor[..., :rotary_dim]
        rot.copy_(_rotate(rot.float(), cos, sin, is_neox).to(tensor.dtype))


@triton.jit
def head_normed(x, rstd, weight, row_ptr):
    """RMSNorm of head vectors as `rms_norm` rounds it: normalised and rounded to the
    activations' dtype (`row_ptr`'s), scaled by the weight fp32 and rounded again (fp32 in
    and out; `x` [heads, dims], `rstd` [heads], `weight` [dims])."""
    dtype = row_ptr.dtype.element_ty
    normed = (x * rstd[:, None]).to(dtype).to(tl.float32)
    return (normed * weight[None, :]).to(dtype).to(tl.float32)


@triton.jit
def _rotate_heads(
    base_ptr,  # this token's head 0
    head_stride,
    dst_ptr,  # where the rotated head 0 goes (base_ptr itself to rotate in place, or a KV cache slot)
    dst_head_stride,
    first_head,
    num_heads,
    cos,  # [BLOCK_HALF] fp32
    sin,  # [BLOCK_HALF] fp32
    HALF: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    HEADS: tl.constexpr,
    IS_NEOX: tl.constexpr,
    norm_w_ptr,  # HEAD_NORM: [2 * HALF] the heads' RMSNorm weight
    norm_eps,
    HEAD_NORM: tl.constexpr,  # RMS-normalise each head first (the rotary spans the whole head)
):
    heads = first_head + tl.arange(0, HEADS)  # [HEADS]
    dims = tl.arange(0, BLOCK_HALF)  # [BLOCK_HALF]
    mask = (heads[:, None] < num_heads) & (dims[None, :] < HALF)  # [HEADS, BLOCK_HALF]
    if IS_NEOX:
        first_cols = dims
        second_cols = dims + HALF
    else:
        first_cols = dims * 2
        second_cols = dims * 2 + 1
    # each thread loads both elements of its pairs before storing them, so in place is safe
    head_ptrs = base_ptr + heads[:, None].to(tl.int64) * head_stride
    dst_ptrs = dst_ptr + heads[:, None].to(tl.int64) * dst_head_stride
    x1 = tl.load(head_ptrs + first_cols[None, :], mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(head_ptrs + second_cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if HEAD_NORM:  # the two halves are the whole head
        rstd = tl.math.rsqrt((tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / (2 * HALF) + norm_eps)
        dim_valid = dims < HALF
        x1 = head_normed(x1, rstd, tl.load(norm_w_ptr + first_cols, mask=dim_valid, other=0.0).to(tl.float32),
                         base_ptr)
        x2 = head_normed(x2, rstd, tl.load(norm_w_ptr + second_cols, mask=dim_valid, other=0.0).to(tl.float32),
                         base_ptr)
    out1 = x1 * cos[None, :] - x2 * sin[None, :]
    out2 = x2 * cos[None, :] + x1 * sin[None, :]
    # rounded to the activations' dtype first, as a rotated k in memory would be before its KV write
    dtype = base_ptr.dtype.element_ty
    tl.store(dst_ptrs + first_cols[None, :], to_cache(out1.to(dtype), dst_ptr), mask=mask)
    tl.store(dst_ptrs + second_cols[None, :], to_cache(out2.to(dtype), dst_ptr), mask=mask)


@triton.jit
def _rotary_kernel(
    q_ptr,  # [T, Hq, D] strided
    k_ptr,  # [T, Hkv, D] strided
    positions_ptr,  # [T]
    cache_ptr,  # [max_pos, 2 * HALF]
    num_q_heads,
    num_kv_heads,
    q_token_stride,
    q_head_stride,
    k_token_stride,
    k_head_stride,
    cache_row_stride,
    HALF: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    HEADS: tl.constexpr,
    IS_NEOX: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    head_block = tl.program_id(1)
    position = tl.load(positions_ptr + token).to(tl.int64)
    dims = tl.arange(0, BLOCK_HALF)
    cache_row = cache_ptr + position * cache_row_stride
    cos = tl.load(cache_row + dims, mask=dims < HALF, other=0.0).to(tl.float32)
    sin = tl.load(cache_row + HALF + dims, mask=dims < HALF, other=0.0).to(tl.float32)
    num_q_blocks = tl.cdiv(num_q_heads, HEADS)
    if head_block < num_q_blocks:
        q_row = q_ptr + token * q_token_stride
        _rotate_heads(
            q_row, q_head_stride, q_row, q_head_stride, head_block * HEADS, num_q_heads,
            cos, sin, HALF, BLOCK_HALF, HEADS, IS_NEOX, q_row, 0.0, False,
        )
    else:
        k_row = k_ptr + token * k_token_stride
        _rotate_heads(
            k_row, k_head_stride, k_row, k_head_stride, (head_block - num_q_blocks) * HEADS,
            num_kv_heads, cos, sin, HALF, BLOCK_HALF, HEADS, IS_NEOX, k_row, 0.0, False,
        )


_rotary_launcher = CachedLauncher(_rotary_kernel)


def apply_rotary(query, key, positions, cos_sin_cache, is_neox: bool = True, impl: Impl = "auto") -> None:
    """Rotate q [T, Hq, D] and k [T, Hkv, D] in place by their positions [T]."""
    if not use_triton(query, impl):
        apply_rotary_reference(query, key, positions, cos_sin_cache, is_neox)
        return
    num_tokens, num_q_heads, head_dim = query.shape
    num_kv_heads = key.shape[1]
    rotary_dim = cos_sin_cache.shape[-1]
    if rotary_dim > head_dim or rotary_dim % 2 or query.stride(-1) != 1 or key.stride(-1) != 1:
        raise ValueError(
            f"need an even rotary_dim <= head_dim ({rotary_dim} vs {head_dim}) and q/k with unit "
            "stride along head_dim"
        )
    if num_tokens == 0:
        return
    half = rotary_dim // 2
    block_half = triton.next_power_of_2(half)
    heads = max(1, min(triton.next_power_of_2(max(num_q_heads, num_kv_heads)), _TILE_ELEMENTS // (2 * block_half)))
    grid = (num_tokens, triton.cdiv(num_q_heads, heads) + triton.cdiv(num_kv_heads, heads))
    _rotary_launcher(
        grid,
        (
            query,
            key,
            positions,
            cos_sin_cache,
            num_q_heads,
            num_kv_heads,
            query.stride(0),
            query.stride(1),
            key.stride(0),
            key.stride(1),
            cos_sin_cache.stride(0),
        ),
        (half, block_half, heads, is_neox),
        4,
    )
