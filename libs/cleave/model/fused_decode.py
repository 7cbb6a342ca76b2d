"""Fused decode layouts: the decoder layers of `cleave.model.llama` laid out for decode batches.

The model file is the maths; this module is the one place that lays that maths out on the
fused Triton kernels for decode batches, and `run_fused_decode` is its one dispatch point
(`CausalLM.forward` calls it and runs its own layers when it declines). It lives beside the
model rather than in `cleave.kernels` because it reads the modules' weights and walks the
layer list; the kernels package stays below the model and knows only tensors.

Two layouts, on the Triton kernels:
- GEMV (1..`CausalLM.decode_gemv_max_tokens` tokens, every model): register, tensor-core or
  split-K GEMV kernels carry the norms in their prologues, the projections' biases (qkv, o and
  router: Qwen2's, gpt-oss's) and the residual adds in their epilogues (four launches a layer,
  plus attention, which takes gpt-oss's sinks and windows itself); a single token without
  q/k norms also takes the rotary embedding and KV write as the qkv projection's epilogue.
  A mixture-of-experts layer of up
  to `moe_gemv.MAX_TOKENS` tokens runs its router on a GEMV with the norm in its prologue,
  the top-k routing, then the per-entry expert GEMVs with the norm in the first one's
  prologue and the residual add in the last one's epilogue (four launches); more tokens
  take the norm, the fused MoE layer and an add. With `SparseMoeBlock.route_in_router` a
  single token's router GEMV routes in its last program (`cleave.kernels.moe_router`: three
  launches).
- deferred norms (dense layers without sinks or biases; larger decode-only batches, after
  `CausalLM.fold_norm_weights`): the
  projections are cuBLAS GEMMs, each norm is a per-row scale that the decode attention and
  SwiGLU kernels apply (`cleave.kernels.row_norm`), and the residual adds are the o and down
  GEMMs' own epilogue (beta = 1): five launches a layer, no norm kernel. The split-K Triton
  kernel in cuBLAS's place (it streams its first weight tile under PDL; nothing to fuse here)
  made the step slower on the H200: batch 64 / 1k 1.88 vs 1.61 ms, batch 32 1.60 vs 1.33
  (bench/results/decode/deferred_gemm/). So did the o projection alone on it with one K tile
  a program, its whole weight slice streamed before its wait while the attention still runs
  (H100, batch 64: 2.126 vs 2.085 ms; with down or qkv as well 2.21-2.39;
  bench/results/decode/deferred_splitk/).

Both update the residual stream in place, so the caller applies the final norm to it.
Every kernel call passes the modules' `pdl` option (`cleave.kernels.pdl`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from cleave.kernels.activation import silu_and_mul
from cleave.kernels.attention import paged_attention
from cleave.kernels.attention_decode import NewKV, paged_decode_attention
from cleave.kernels.dispatch import use_triton
from cleave.kernels.fused_moe import route
from cleave.kernels.gemv import AUTO_MAX_ROWS as GEMV_AUTO_MAX_ROWS
from cleave.kernels.gemv import RotaryKVWrite
from cleave.kernels.moe_gemv import MAX_TOKENS as MOE_GEMV_MAX_TOKENS
from cleave.kernels.moe_gemv import moe_gemv
from cleave.kernels.moe_router import router_route
from cleave.kernels.rms_norm import rms_norm
from cleave.kernels.row_norm import DeferredRMSNorm
from cleave.kernels.small_linear import small_linear
from cleave.kv.metadata import AttentionMetadata
from cleave.model.moe import SparseMoeBlock

if TYPE_CHECKING:
    from cleave.model.llama import MLP, Attention, CausalLM, DecoderLayer, RMSNorm

# Batches of up to this many tokens take the GEMV layout by default (see
# `CausalLM.decode_gemv_max_tokens`); above it, cuBLAS GEMMs with separate norm kernels.
DECODE_GEMV_MAX_TOKENS = 16


def run_fused_decode(
    model: CausalLM,
    hidden: torch.Tensor,  # [T, H] embeddings; becomes the residual stream, updated in place
    positions: torch.Tensor,  # [T]
    layer_kv: list[tuple[torch.Tensor, AttentionMetadata]],  # each layer's cache slot and metadata
    metadata: AttentionMetadata,
) -> bool:
    """Run every layer on the fused decode layout that fits this batch; False (and `hidden`
    untouched) when none does."""
    if gemv_layout_applies(model, hidden):
        layer_fn = _gemv_layer
    elif deferred_norm_layout_applies(model, hidden, metadata):
        layer_fn = _deferred_norm_layer
    else:
        return False
    for layer, (cache, layer_metadata) in zip(model.layers, layer_kv):
        layer_fn(layer, hidden, positions, cache, layer_metadata, model.cos_sin_cache)
    return True


def gemv_layout_applies(model: CausalLM, hidden: torch.Tensor) -> bool:
    """Whether this batch runs the GEMV layout: Triton kernels (on CUDA, or forced) and
    1..decode_gemv_max_tokens tokens."""
    return (
        0 < hidden.shape[0] <= model.decode_gemv_max_tokens
        and model.has_gemv_decode_layout
        and use_triton(hidden, model.impl)
        and use_triton(hidden, model.layers[0].self_attn.attention_impl)
    )


def deferred_norm_layout_applies(model: CausalLM, hidden: torch.Tensor, metadata: AttentionMetadata) -> bool:
    """Whether this batch runs the deferred-norm layout: a decode-only batch on the Triton
    kernels with the norm weights folded, no qkv bias or q/k norms, a full-width rotary
    embedding, and the rotary embedding inside the decode attention kernel enabled."""
    config = model.config
    attention = model.layers[0].self_attn if model.layers else None
    return (
        model.norms_folded
        and model.has_fused_decode_layouts
        and model.deferred_norm_decode
        and attention is not None
        and attention.rotary_in_decode_attention
        and metadata.is_decode_only
        and hidden.shape[0] > 0
        and not config.attention_bias
        and not config.qk_norm
        and model.cos_sin_cache.shape[-1] == config.head_dim
        and use_triton(hidden, model.impl)
        and use_triton(hidden, attention.attention_impl)
    )


# ---- GEMV layout ---------------------------------------------------------------------------


def _gemv_layer(
    layer: DecoderLayer,
    residual: torch.Tensor,  # [T, H], T <= decode_gemv_max_tokens: the residual stream, updated in place
    positions: torch.Tensor,
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, Hkv, D]
    metadata: AttentionMetadata,
    cos_sin_cache: torch.Tensor,
) -> None:
    """One decoder layer with the norms fused into the projections that read them and the
    residual adds into the projections that produce them."""
    _gemv_attention(layer.self_attn, residual, layer.input_layernorm, positions, kv_cache, metadata, cos_sin_cache)
    if isinstance(layer.mlp, SparseMoeBlock):
        _gemv_moe(layer.mlp, residual, layer.post_attention_layernorm, metadata.split_counters)
    else:
        _gemv_mlp(layer.mlp, residual, layer.post_attention_layernorm, metadata.split_counters)


def _gemv_attention(
    attention: Attention,
    residual: torch.Tensor,  # [T, H]; updated in place
    norm: RMSNorm,  # the layer's input norm, fused into the qkv projection
    positions: torch.Tensor,
    kv_cache: torch.Tensor,
    metadata: AttentionMetadata,
    cos_sin_cache: torch.Tensor,
) -> None:
    """residual += o_proj(attention(qkv_proj(norm(residual)))).

    A single token without q/k norms takes the rotary embedding and KV write as the qkv
    projection's epilogue (one launch fewer per layer)."""
    num_tokens, pdl = residual.shape[0], attention.pdl
    if num_tokens <= GEMV_AUTO_MAX_ROWS and attention.q_norm is None:
        rotary = RotaryKVWrite(positions, cos_sin_cache, kv_cache, metadata.slot_mapping,
                               attention.num_heads, attention.num_kv_heads, attention.head_dim, is_neox=True)
        qkv = small_linear(residual, attention.qkv_proj.weight, norm_weight=norm.weight, eps=norm.eps, rotary=rotary,
                           bias=attention.qkv_proj.bias, pdl=pdl)
        q = qkv[:, : attention.q_size].view(num_tokens, attention.num_heads, attention.head_dim)
        out = paged_attention(q, kv_cache, metadata, attention.scale, impl="triton",
                              sliding_window=attention.sliding_window, sinks=attention.sinks, pdl=pdl,
                              prefill=attention.prefill_launch)
        out = out.reshape(num_tokens, attention.q_size)
    else:
        qkv = small_linear(residual, attention.qkv_proj.weight, norm_weight=norm.weight, eps=norm.eps,
                           bias=attention.qkv_proj.bias, counters=metadata.split_counters, pdl=pdl)
        out = attention.attend(qkv, positions, kv_cache, metadata, cos_sin_cache)  # [T, Hq D]
    small_linear(out, attention.o_proj.weight, add_to=residual, bias=attention.o_proj.bias,
                 counters=metadata.split_counters, pdl=pdl)


def _gemv_mlp(mlp: MLP, residual: torch.Tensor, norm: RMSNorm, counters: torch.Tensor | None) -> None:
    """residual += down(silu(gate) * up) of norm(residual), as two kernels (`counters`: the
    split-K kernel's scratch, see AttentionMetadata.split_counters)."""
    act = small_linear(residual, mlp.gate_up_proj.weight, gated=True, norm_weight=norm.weight, eps=norm.eps,
                       counters=counters, pdl=mlp.pdl)
    small_linear(act, mlp.down_proj.weight, add_to=residual, counters=counters, pdl=mlp.pdl)  # [T, I] -> += [T, H]


def _gemv_moe(block: SparseMoeBlock, residual: torch.Tensor, norm: RMSNorm, counters: torch.Tensor | None) -> None:
    """residual += block(norm(residual)): up to `moe_gemv.MAX_TOKENS` tokens with the norm
    inside the router and expert GEMVs, the routing in a launch of its own (gpt-oss's softmax
    over its top-k logits is softmax-then-renormalise) and the add in the last GEMV (see the
    module doc). Routing inside the first expert GEMV instead (`block.route_in_gemv`), one
    launch fewer, was slower on an H200 for Qwen3-30B-A3B (its layer at 1 / 2 / 4 tokens: 44.3 /
    61.7 / 91.6 us with the route launch, 47.5 / 66.0 / 106.9 without;
    bench/results/moe/moe-layer-20261205T040729Z.md). A single token's router GEMV routes in
    its last program instead with `block.route_in_router` (`counters`: its scratch, see
    AttentionMetadata.split_counters)."""
    if residual.shape[0] > MOE_GEMV_MAX_TOKENS:
        residual.add_(block(rms_norm(residual, norm.weight, norm.eps, pdl=norm.pdl)))
        return
    experts, pdl, router = block.experts, norm.pdl, block.router
    if block.route_in_router and residual.shape[0] == 1:
        _, weights, ids = router_route(residual, router.weight, block.top_k, block.renormalize, norm.weight, norm.eps,
                                       router.bias, counters=counters, pdl=pdl, tiles=block.router_tiles)
    else:
        logits = small_linear(residual, router.weight, norm_weight=norm.weight, eps=norm.eps, bias=router.bias,
                              pdl=pdl)
        if block.route_in_gemv:
            moe_gemv(residual, experts.gate_up, experts.down, None, None, block.activation, experts.w13_bias,
                     experts.w2_bias, norm_weight=norm.weight, eps=norm.eps, add_to=residual, router_logits=logits,
                     top_k=block.top_k, renormalize=block.renormalize, pdl=pdl)
            return
        weights, ids = route(logits, block.top_k, block.renormalize, pdl=pdl)
    moe_gemv(residual, experts.gate_up, experts.down, weights, ids, block.activation, experts.w13_bias, experts.w2_bias,
             norm_weight=norm.weight, eps=norm.eps, add_to=residual, pdl=pdl)


# ---- deferred-norm layout ------------------------------------------------------------------


def _deferred_norm_layer(
    layer: DecoderLayer,
    residual: torch.Tensor,  # [T, H] residual stream of a decode-only batch, updated in place
    positions: torch.Tensor,
    kv_cache: torch.Tensor,
    metadata: AttentionMetadata,
    cos_sin_cache: torch.Tensor,
) -> None:
    """One decoder layer on GEMMs with the norm weights folded into qkv_proj and gate_up_proj:
    the norms are applied by the attention and SwiGLU kernels, the adds by the o and down GEMMs."""
    _deferred_norm_attention(layer.self_attn, residual, layer.input_layernorm.eps, positions, kv_cache, metadata,
                             cos_sin_cache)
    _deferred_norm_mlp(layer.mlp, residual, layer.post_attention_layernorm.eps)  # type: ignore[arg-type]


def _deferred_norm_attention(
    attention: Attention,
    residual: torch.Tensor,  # [T, H]; updated in place
    norm_eps: float,  # the layer's input norm, whose (unit) weight is folded into qkv_proj
    positions: torch.Tensor,
    kv_cache: torch.Tensor,
    metadata: AttentionMetadata,
    cos_sin_cache: torch.Tensor,
) -> None:
    """residual += o_proj(attention(qkv_proj(norm(residual)))) with the norm applied by the
    decode attention kernel (with the rotary embedding and the KV write) and the add by the
    o GEMM (beta = 1)."""
    num_tokens, head_dim = residual.shape[0], attention.head_dim
    qkv = torch.mm(residual, attention.qkv_proj.weight.t())  # [T, (Hq + 2 Hkv) D], unnormalised
    q, k, v = qkv.split([attention.q_size, attention.kv_size, attention.kv_size], dim=-1)
    new_kv = NewKV(
        k.view(num_tokens, attention.num_kv_heads, head_dim), v.view(num_tokens, attention.num_kv_heads, head_dim),
        positions, cos_sin_cache, metadata.slot_mapping, is_neox=True,
        row_norm=DeferredRMSNorm(residual, norm_eps),
    )
    out = paged_decode_attention(q.view(num_tokens, attention.num_heads, head_dim), kv_cache, metadata,
                                 attention.scale, sliding_window=attention.sliding_window, new_kv=new_kv,
                                 sinks=attention.sinks, pdl=attention.pdl)
    residual.addmm_(out.view(num_tokens, attention.q_size), attention.o_proj.weight.t())


def _deferred_norm_mlp(mlp: MLP, residual: torch.Tensor, norm_eps: float) -> None:
    """residual += down(silu(gate) * up) of norm(residual), the norm's weight folded into
    gate_up_proj and its per-row scale applied by the SwiGLU kernel, the add by the down
    GEMM (beta = 1)."""
    gate_up = torch.mm(residual, mlp.gate_up_proj.weight.t())  # [T, 2I], unnormalised
    act = silu_and_mul(gate_up, impl=mlp.impl, row_norm=DeferredRMSNorm(residual, norm_eps), pdl=mlp.pdl)
    residual.addmm_(act, mlp.down_proj.weight.t())
