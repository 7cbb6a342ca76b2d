"""Rotary inverse frequencies and the cos/sin cache consumed by `cleave.kernels.rotary`.

Inverse frequencies follow transformers' `modeling_rope_utils` operation for operation
(same dtypes, same order), so the cache matches HF's cos/sin bit for bit in float32.
"""

from __future__ import annotations

import math
from typing import Any

import torch

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def compute_inv_freq(rotary_dim: int, rope_theta: float, rope_scaling: dict[str, Any] | None) -> torch.Tensor:
    """[rotary_dim / 2] float32 inverse frequencies, scaled as `rope_scaling` says."""
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64, device="cpu").to(dtype=torch.float) / rotary_dim
    inv_freq = 1.0 / (rope_theta**exponents)
    rope_type = (rope_scaling or {}).get("rope_type", "default")
    if rope_type == "default":
        return inv_freq
    assert rope_scaling is not None
    if rope_type == "linear":
        return inv_freq / rope_scaling["factor"]
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, rope_scaling)
    if rope_type == "yarn":
        return _yarn_inv_freq(rotary_dim, rope_theta, rope_scaling)
    raise ValueError(f"unsupported rope_type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    # Llama 3.1: long wavelengths are divided by `factor`, short ones kept, the band between
    # the two thresholds interpolated smoothly.
    factor = scaling["factor"]
    low_freq_factor = scaling["low_freq_factor"]
    high_freq_factor = scaling["high_freq_factor"]
    old_context_len = scaling["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor

    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn_inv_freq(rotary_dim: int, rope_theta: float, scaling: dict[str, Any]) -> torch.Tensor:
    # YaRN (gpt-oss): frequencies above the beta_fast band kept, those below beta_slow
    # divided by `factor`, a linear ramp between the two.
    factor = scaling["factor"]
    original_max = scaling["original_max_position_embeddings"]
    beta_fast = scaling.get("beta_fast") or 32
    beta_slow = scaling.get("beta_slow") or 1

    def correction_dim(num_rotations: float) -> float:
        return (rotary_dim * math.log(original_max / (num_rotations * 2 * math.pi))) / (2 * math.log(rope_theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    pos_freqs = rope_theta ** (torch.arange(0, rotary_dim, 2, device="cpu").to(dtype=torch.float) / rotary_dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    ramp = torch.clamp((torch.arange(rotary_dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation_factor = 1 - ramp
    return interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor


def attention_factor(rope_scaling: dict[str, Any] | None) -> float:
    """The factor YaRN applies to cos and sin (1 for every other rope type)."""
    if (rope_scaling or {}).get("rope_type") != "yarn":
        return 1.0
    assert rope_scaling is not None
    if rope_scaling.get("attention_factor") is not None:
        return float(rope_scaling["attention_factor"])
    factor = rope_scaling["factor"]

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if rope_scaling.get("mscale") and rope_scaling.get("mscale_all_dim"):
        return float(mscale(factor, rope_scaling["mscale"]) / mscale(factor, rope_scaling["mscale_all_dim"]))
    return mscale(factor)


def build_cos_sin_cache(
    rotary_dim: int,
    max_position: int,
    rope_theta: float,
    rope_scaling: dict[str, Any] | None = None,
) -> torch.Tensor:
    """[max_position, rotary_dim] float32 on CPU: cos in the first half of columns, sin in the rest."""
    inv_freq = compute_inv_freq(rotary_dim, rope_theta, rope_scaling)  # [R/2]
    positions = torch.arange(max_position, dtype=torch.int64, device="cpu").float()  # [P]
    freqs = positions[:, None] * inv_freq[None, :]  # [P, R/2]
    cache = torch.cat((freqs.cos(), freqs.sin()), dim=-1)
    scale = attention_factor(rope_scaling)
    return cache if scale == 1.0 else cache * scale
