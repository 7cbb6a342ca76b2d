"""Rotary embedding, KV write and paged attention as one op, with the kernel layout chosen here.

The model's attention is "rotate q and k, write k and v into the cache, attend"; which
kernels carry that out is a kernel-side choice:
- a decode-only batch on the Triton kernels with a full-width rotary table: one launch, the
  split-KV decode kernel rotates q and k (after their per-head norms, `head_norms`, when the
  model has them) and writes k and v itself (`NewKV`);
- other batches on the Triton kernels: `rotary_write_kv` (one launch for the head norms,
  rotary and the KV write), then `paged_attention`;
- otherwise the rotary op on `impl`, then the KV write and attention on `attention_impl`.
Outside those fused layouts (or with a partial rotary) `head_norms` run first, as two RMSNorm
launches.

The cache work is kept out of `torch.compile` graphs (`outside_compiled_graphs`): the Triton
kernels are opaque to Dynamo and the torch reference walks the batch on the host
(`.tolist()`), so graphs split cleanly around it while the rotary reference stays inside.
"""

from __future__ import annotations

import torch

from cleave.kernels.attention import paged_attention, write_kv
from cleave.kernels.attention_decode import HeadNorms, NewKV, paged_decode_attention
from cleave.kernels.attention_prefill import DEFAULT_PREFILL_LAUNCH, PrefillLaunch
from cleave.kernels.dispatch import Impl, outside_compiled_graphs, use_triton
from cleave.kernels.rms_norm import rms_norm
from cleave.kernels.rotary import apply_rotary
from cleave.kernels.rotary_kv_write import rotary_write_kv
from cleave.kv.metadata import AttentionMetadata


def rotary_paged_attention(
    q: torch.Tensor,  # [T, Hq, D]
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, D]
    positions: torch.Tensor,  # [T]
    cos_sin_cache: torch.Tensor,  # [max_position, D] float32
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, Hkv, D]
    metadata: AttentionMetadata,
    scale: float,
    *,
    impl: Impl = "auto",
    attention_impl: Impl = "auto",
    sliding_window: int | None = None,
    sinks: torch.Tensor | None = None,  # [Hq]
    rotary_in_decode_kernel: bool = True,
    pdl: bool = True,
    head_norms: HeadNorms | None = None,
    prefill: PrefillLaunch = DEFAULT_PREFILL_LAUNCH,
) -> torch.Tensor:  # [T, Hq, D]
    """Attention of q (NeoX-rotated) over the cache after writing the rotated k and v
    (`head_norms`: q and k RMS-normalised per head before the rotation).

    `impl` picks the rotary side and `attention_impl` the KV write and attention (see
    `cleave.model.compiled`); the fused layouts need both on Triton. `rotary_in_decode_kernel`
    False keeps decode batches on the two-launch layout (A/B benchmarks). `pdl`: see
    `cleave.kernels.pdl`. `prefill`: how batches with prompt tokens launch the prefill kernel.
    """
    fused = use_triton(q, impl) and use_triton(q, attention_impl)
    if fused and rotary_in_decode_kernel and metadata.is_decode_only and cos_sin_cache.shape[-1] == q.shape[-1]:
        # one launch: the decode kernel normalises and rotates q and k and writes k and v itself
        new_kv = NewKV(k, v, positions, cos_sin_cache, metadata.slot_mapping, is_neox=True, head_norms=head_norms)
        return _decode_attention(q, kv_cache, metadata, scale, sliding_window, new_kv, sinks, pdl)
    norms_in_rotary = fused and cos_sin_cache.shape[-1] == q.shape[-1]
    if head_norms is not None and not norms_in_rotary:
        q, k = _normed_heads(q, head_norms.q_weight, head_norms.eps, impl, pdl), _normed_heads(
            k, head_norms.k_weight, head_norms.eps, impl, pdl)
        head_norms = None
    if fused:
        return _fused_rotary_attention(q, k, v, positions, cos_sin_cache, kv_cache, metadata, scale, sliding_window,
                                       sinks, pdl, prefill, head_norms)
    apply_rotary(q, k, positions, cos_sin_cache, is_neox=True, impl=impl)
    return _cached_attention(q, k, v, kv_cache, metadata, scale, attention_impl, sliding_window, sinks, pdl, prefill)


@outside_compiled_graphs
def _cached_attention(
    q: torch.Tensor,  # [T, Hq, D]
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, D]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, Hkv, D]
    metadata: AttentionMetadata,
    scale: float,
    impl: Impl,
    sliding_window: int | None,
    sinks: torch.Tensor | None,  # [Hq]
    pdl: bool,
    prefill: PrefillLaunch,
) -> torch.Tensor:  # [T, Hq, D]
    write_kv(k, v, kv_cache, metadata.slot_mapping, impl=impl)
    return paged_attention(q, kv_cache, metadata, scale, impl=impl, sliding_window=sliding_window, sinks=sinks,
                           pdl=pdl, prefill=prefill)


def _normed_heads(x: torch.Tensor, weight: torch.Tensor, eps: float, impl: Impl, pdl: bool) -> torch.Tensor:
    """[T, H, D] -> RMSNorm of every head vector with its [D] weight (a new tensor)."""
    num_tokens, num_heads, head_dim = x.shape
    return rms_norm(x.reshape(-1, head_dim), weight, eps, impl=impl, pdl=pdl).view(num_tokens, num_heads, head_dim)


@outside_compiled_graphs
def _decode_attention(
    q: torch.Tensor,  # [T, Hq, D], unrotated
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, Hkv, D]
    metadata: AttentionMetadata,
    scale: float,
    sliding_window: int | None,
    new_kv: NewKV,
    sinks: torch.Tensor | None,  # [Hq]
    pdl: bool,
) -> torch.Tensor:  # [T, Hq, D]
    return paged_decode_attention(q, kv_cache, metadata, scale, sliding_window=sliding_window, new_kv=new_kv,
                                  sinks=sinks, pdl=pdl)


@outside_compiled_graphs
def _fused_rotary_attention(
    q: torch.Tensor,  # [T, Hq, D]
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, D]
    positions: torch.Tensor,  # [T]
    cos_sin_cache: torch.Tensor,  # [max_position, D] float32
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, Hkv, D]
    metadata: AttentionMetadata,
    scale: float,
    sliding_window: int | None,
    sinks: torch.Tensor | None,  # [Hq]
    pdl: bool,
    prefill: PrefillLaunch,
    head_norms: HeadNorms | None,
) -> torch.Tensor:  # [T, Hq, D]
    rotary_write_kv(q, k, v, positions, cos_sin_cache, kv_cache, metadata.slot_mapping, is_neox=True, impl="triton",
                    pdl=pdl, head_norms=head_norms)
    return paged_attention(q, kv_cache, metadata, scale, impl="triton", sliding_window=sliding_window, sinks=sinks,
                           pdl=pdl, prefill=prefill)
