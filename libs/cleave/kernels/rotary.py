"""Rotary position embedding applied in place to q and k (NeoX and GPT-J layouts).

cos_sin_cache: [max_position, rotary_dim] with cos in the first rotary_dim/2 columns and sin
in the rest; rope-scaling variants only change how the cache is built.
"""

from __future__ import annotations

import torch

from cleave.kernels.dispatch import Impl, use_triton


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


def apply_rotary(query, key, positions, cos_sin_cache, is_neox: bool = True, impl: Impl = "auto") -> None:
    """Rotate q and k in place by their positions."""
    use_triton(query, impl)
    apply_rotary_reference(query, key, positions, cos_sin_cache, is_neox)
