"""The KV cache's element type: the model's dtype ("auto") or float8 e4m3 ("fp8").

An fp8 cache holds half the bytes of a bf16 one, so twice the tokens fit in the same memory
and decode attention reads half as much. Values are stored with a per-tensor scale of 1.0
(what vLLM does for a checkpoint without KV scales): clamped to e4m3's +-448 and rounded to
nearest, ties to even, never NaN. Every kernel that writes the cache casts through `to_cache`
(Triton) and every torch path through `to_cache_dtype`, so the two agree bit for bit; readers
upcast what they load to their compute dtype (`cleave.kernels.attention_common.load_kv_tile`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

FP8_E4M3_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max; e4m3fn has no infinity
_FP8_E4M3_MAX = tl.constexpr(FP8_E4M3_MAX)  # the same, for the kernels
_CACHE_DTYPES = {"fp8": torch.float8_e4m3fn}  # CacheConfig.kv_cache_dtype -> element type; "auto": the model's
# the same bits as integers of the element's width, for copies torch has no float8 kernel for
_WORDS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def resolve_kv_cache_dtype(setting: str, model_dtype: torch.dtype) -> torch.dtype:
    """The cache's element type for a `CacheConfig.kv_cache_dtype` setting."""
    if setting == "auto":
        return model_dtype
    if setting not in _CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be auto or {', '.join(_CACHE_DTYPES)}, got {setting!r}")
    return _CACHE_DTYPES[setting]


def to_cache_dtype(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`x` as the cache's `dtype`. Torch does not promise that its cast to float8_e4m3fn
    saturates (versions and devices have made NaN past +-448), so an fp8 cache clamps first,
    in fp32 (exact for every activation dtype)."""
    if dtype == torch.float8_e4m3fn:
        x = x.float().clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX)
    return x.to(dtype)


def as_words(tensor: torch.Tensor) -> torch.Tensor:
    """The same memory as integers of the element's width (same shape, bits unchanged): CPU
    `index_copy_` has no float8 kernel, and a copy of bits needs none."""
    return tensor.view(_WORDS[tensor.element_size()])


@triton.jit
def _e4m3_grid(x):
    """fp32 `x` (|x| <= 448) rounded to the nearest float8 e4m3 value, ties to even, as fp32.

    The cast of such a value to e4m3 is exact on every backend; the Triton interpreter's own
    rounding to float8 rounds half up and loses the carry into the exponent (124 -> 64)."""
    bits = x.to(tl.int32, bitcast=True)
    exponent = ((bits >> 23) & 0xFF) - 127
    # e4m3 keeps 3 mantissa bits; below its smallest normal (2^-6) values are spaced 2^-9
    ulp_exponent = tl.maximum(exponent, -6) - 3
    ulp = ((ulp_exponent + 127) << 23).to(tl.float32, bitcast=True)
    inv_ulp = ((127 - ulp_exponent) << 23).to(tl.float32, bitcast=True)
    # |x| / ulp < 16: adding and taking away 1.5 * 2^23 rounds it to an integer, ties to even
    steps = (tl.abs(x) * inv_ulp + 12582912.0) - 12582912.0
    magnitude = (steps * ulp).to(tl.int32, bitcast=True)
    sign = (bits >> 31) << 31  # -0.0 and values rounding to zero keep their sign, as torch's cast
    return (magnitude | sign).to(tl.float32, bitcast=True)


@triton.jit
def to_cache(x, cache_ptr):
    """`x` cast for a store through `cache_ptr`: into a float8 e4m3 cache clamped to +-448 and
    rounded to nearest even (as `to_cache_dtype`); any other element type a plain cast."""
    dtype: tl.constexpr = cache_ptr.dtype.element_ty
    if dtype == tl.float8e4nv:
        x = _e4m3_grid(tl.clamp(x.to(tl.float32), -_FP8_E4M3_MAX, _FP8_E4M3_MAX))
    return x.to(dtype)
