"""Llama-family decoder (Llama 2/3, Mistral, Qwen2, Qwen3, Qwen3-MoE, gpt-oss) over a flattened, paged batch.

The batch has no batch dimension: `input_ids` and `positions` are `[T]`, the new tokens of
every sequence concatenated; `AttentionMetadata` says which tokens belong to which sequence
and where their K/V live in the paged cache. Architecture differences are config flags:
q/k/v bias (Qwen2), per-head q/k RMSNorm (Qwen3), tied embeddings, rope scaling, sparse
MoE blocks in place of the MLP (`cleave.model.moe`), o_proj bias, per-layer sliding windows
and attention sinks (gpt-oss).

q/k/v are one `qkv_proj` Linear and gate/up one `gate_up_proj` Linear (the loader fuses the
HF tensors), so each projection is one GEMM. The forward does no host syncs, so it can be
captured in a CUDA graph.

The modules here are the maths. Decode batches on the Triton kernels run the same layers in
fused layouts (norms inside the projections, residual adds in their epilogues, or norms
deferred into the attention and SwiGLU kernels): `cleave.model.fused_decode`, which
`CausalLM.forward` asks first. Those layouts are for dense layers without sinks or an
o_proj bias; other models run these layers on every batch. Every module carries `impl` (which side of each kernel op
runs) and `pdl` (programmatic dependent launch, `cleave.kernels.pdl`) and passes both to
each kernel call.
"""

from __future__ import annotations

import torch
from torch import nn

from cleave.kernels.activation import silu_and_mul
from cleave.kernels.attention import warm_mixed_decodes
from cleave.kernels.attention_decode import HeadNorms
from cleave.kernels.attention_prefill import prefill_launch_for
from cleave.kernels.dispatch import Impl, use_triton
from cleave.kernels.embedding import embedding
from cleave.kernels.gemv import AUTO_MAX_ROWS as GEMV_AUTO_MAX_ROWS
from cleave.kernels.rms_norm import fused_add_rms_norm, rms_norm
from cleave.kernels.rotary_attention import rotary_paged_attention
from cleave.kernels.small_linear import small_linear
from cleave.kv.groups import kv_groups
from cleave.kv.metadata import AttentionMetadata
from cleave.model.config import ModelConfig
from cleave.model.fused_decode import DECODE_GEMV_MAX_TOKENS, run_fused_decode
from cleave.model.moe import SparseMoeBlock
from cleave.model.projection import project
from cleave.model.rope import build_cos_sin_cache


class RMSNorm(nn.Module):
    """RMSNorm weight; `forward(x, residual)` fuses the residual add when one is given."""

    def __init__(self, size: int, eps: float, impl: Impl = "auto", pdl: bool = True) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps
        self.impl: Impl = impl
        self.pdl = pdl

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        # x: [N, size]; residual: [N, size], updated in place to residual + x
        if residual is None:
            return rms_norm(x, self.weight, self.eps, impl=self.impl, pdl=self.pdl)
        return fused_add_rms_norm(x, residual, self.weight, self.eps, impl=self.impl, pdl=self.pdl)


class Attention(nn.Module):
    """Grouped-query self-attention with rotary positions over one layer's paged KV cache;
    with `sinks` [Hq] (gpt-oss), one learned logit per head joins every softmax."""

    def __init__(self, config: ModelConfig, impl: Impl = "auto", layer: int = 0, pdl: bool = True) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size, self.kv_size = config.q_size, config.kv_size
        self.scale = self.head_dim**-0.5
        self.sliding_window = config.layer_sliding_window(layer)
        self.impl: Impl = impl
        self.attention_impl: Impl = impl  # KV write + paged attention; see compiled.py
        self.pdl = pdl
        # decode-only batches: rotary + KV write inside the decode attention kernel (one launch)
        self.rotary_in_decode_attention = True
        # how batches with prompt tokens launch the prefill attention kernel (tuned by head size;
        # A/B benchmarks set others)
        self.prefill_launch = prefill_launch_for(self.head_dim)
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.attention_bias)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=config.o_proj_bias)
        self.sinks = nn.Parameter(torch.empty(self.num_heads)) if config.attention_sinks else None
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, impl, pdl) if config.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, impl, pdl) if config.qk_norm else None

    def forward(
        self,
        hidden: torch.Tensor,  # [T, H]
        positions: torch.Tensor,  # [T]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, Hkv, D]
        metadata: AttentionMetadata,
        cos_sin_cache: torch.Tensor,  # [max_position, D] float32
    ) -> torch.Tensor:  # [T, H]
        qkv = project(self.qkv_proj, hidden, self.impl, self.pdl)  # [T, (Hq + 2 Hkv) D]
        return project(self.o_proj, self.attend(qkv, positions, kv_cache, metadata, cos_sin_cache), self.impl, self.pdl)

    def attend(
        self,
        qkv: torch.Tensor,  # [T, (Hq + 2 Hkv) D]
        positions: torch.Tensor,  # [T]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, Hkv, D]
        metadata: AttentionMetadata,
        cos_sin_cache: torch.Tensor,  # [max_position, D] float32
    ) -> torch.Tensor:  # [T, Hq D], before o_proj
        """Split the fused projection, then the q/k norms, rotary, KV write and attention
        (the norms inside the decode attention kernel where it takes the rotary too)."""
        num_tokens = qkv.shape[0]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)  # [T, Hq, D]
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        head_norms = None
        if self.q_norm is not None and self.k_norm is not None:
            head_norms = HeadNorms(self.q_norm.weight, self.k_norm.weight, self.q_norm.eps)
        out = rotary_paged_attention(
            q, k, v, positions, cos_sin_cache, kv_cache, metadata, self.scale, impl=self.impl,
            attention_impl=self.attention_impl, sliding_window=self.sliding_window, sinks=self.sinks,
            rotary_in_decode_kernel=self.rotary_in_decode_attention, pdl=self.pdl, head_norms=head_norms,
            prefill=self.prefill_launch,
        )  # [T, Hq, D]
        return out.reshape(num_tokens, self.q_size)

    def warm_mixed_decodes(self, kv_cache: torch.Tensor, max_decodes: int) -> int:
        """Compile now the decode-kernel variants a mixed step's decodes can launch
        (`PrefillLaunch.decode_rows`), rather than in a serving step; nothing is written.
        `kv_cache` is a layer's [2, num_blocks, block_size, Hkv, D]. Returns the launches."""
        if not self.prefill_launch.decode_rows or not use_triton(kv_cache, self.attention_impl) or max_decodes < 1:
            return 0
        # the activations' dtype, not the cache's (an fp8 cache holds what bf16 queries attend over)
        qkv = torch.zeros(max_decodes, self.q_size + 2 * self.kv_size, dtype=self.qkv_proj.weight.dtype,
                          device=kv_cache.device)
        query = qkv[:, : self.q_size].view(max_decodes, self.num_heads, self.head_dim)  # as `attend` splits it
        return warm_mixed_decodes(query, kv_cache, self.scale, self.sliding_window, self.sinks, self.pdl)


class MLP(nn.Module):
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x)) with gate and up in one GEMM."""

    def __init__(self, config: ModelConfig, impl: Impl = "auto", pdl: bool = True) -> None:
        super().__init__()
        self.impl: Impl = impl
        self.pdl = pdl
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(hidden)  # [T, 2I]
        return self.down_proj(silu_and_mul(gate_up, impl=self.impl, pdl=self.pdl))  # [T, I] -> [T, H]


class DecoderLayer(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then + mlp(norm(.)); residual adds fused into the norms.
    The mlp is a `SparseMoeBlock` in the config's `moe_layers`."""

    def __init__(self, config: ModelConfig, impl: Impl = "auto", layer: int = 0, pdl: bool = True) -> None:
        super().__init__()
        self.self_attn = Attention(config, impl, layer, pdl)
        is_sparse = layer in config.moe_layers
        self.mlp: MLP | SparseMoeBlock = SparseMoeBlock(config, impl) if is_sparse else MLP(config, impl, pdl)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, impl, pdl)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, impl, pdl)

    def forward(
        self,
        hidden: torch.Tensor,  # [T, H]: previous layer's output (the embeddings for layer 0)
        residual: torch.Tensor | None,  # [T, H] running residual stream, None for layer 0
        positions: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        cos_sin_cache: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(hidden, positions, kv_cache, metadata, cos_sin_cache)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class CausalLM(nn.Module):
    """Decoder-only LM: token ids of a flattened batch -> final hidden states -> logits.

    Module names mirror HF's (`layers.{i}.self_attn.qkv_proj`, ...) without the `model.`
    prefix; `cos_sin_cache` is a float32 buffer that stays float32 whatever dtype the
    weights are moved to. `impl` picks the kernel side of every op ("torch" forces the
    references, e.g. for `torch.compile`); `pdl` False launches no kernel with programmatic
    dependent launch (`EngineConfig.pdl`).
    """

    def __init__(self, config: ModelConfig, impl: Impl = "auto", pdl: bool = True) -> None:
        super().__init__()
        self.config = config
        self.impl: Impl = impl
        self.pdl = pdl
        # built on the meta device (`loader.empty_model`) the table is left uninitialised, as
        # every weight is loaded: nn.Embedding's normal_ on meta imports torch._dynamo (1.4 s
        # of a worker's start on a 2-core host)
        on_meta = torch.get_default_device().type == "meta"
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, _weight=torch.empty(
            config.vocab_size, config.hidden_size) if on_meta else None)
        self.layers = nn.ModuleList(
            DecoderLayer(config, impl, index, pdl) for index in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, impl, pdl)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        # the paired cache plan (cleave.kv.groups), taken when a cache has fewer slots than layers
        self.paired_kv = kv_groups(config, pair_window_layers=True)
        # fused decode layouts (cleave.model.fused_decode): GEMV up to this many tokens (<= small_linear.MAX_ROWS)
        self.decode_gemv_max_tokens = DECODE_GEMV_MAX_TOKENS
        self.norms_folded = False  # set by fold_norm_weights
        self.deferred_norm_decode = True  # larger decode batches apply folded norms in kernels
        # the deferred-norm layout folds norms into dense projections and drops biases; the GEMV
        # layout lays out every model (biases in its epilogues, MoE layers' norms unfolded)
        self.has_fused_decode_layouts = not (config.is_moe or config.attention_sinks or config.o_proj_bias)
        self.has_gemv_decode_layout = True
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        cache = self._build_cos_sin_cache(self.embed_tokens.weight.device)
        self.register_buffer("cos_sin_cache", cache, persistent=False)

    def _build_cos_sin_cache(self, device: torch.device) -> torch.Tensor:
        config = self.config
        if device.type == "meta":
            shape = (config.max_position_embeddings, config.head_dim)
            return torch.empty(shape, dtype=torch.float32, device=device)
        cache = build_cos_sin_cache(
            config.head_dim, config.max_position_embeddings, config.rope_theta, config.rope_scaling
        )
        return cache.to(device)

    def _apply(self, fn, recurse=True):  # type: ignore[no-untyped-def]
        # `.to(bfloat16)` would round the rotary table and `to_empty()` would leave it
        # uninitialised, so it is rebuilt in float32 on whatever device the weights now use.
        super()._apply(fn, recurse)
        # Moving from the meta device makes a new Parameter per module, breaking the tie.
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.cos_sin_cache = self._build_cos_sin_cache(self.cos_sin_cache.device)
        return self

    @torch.no_grad()
    def fold_norm_weights(self) -> "CausalLM":
        """Fold each layer's input and post-attention RMSNorm weights into the projections
        that read them (qkv_proj, gate_up_proj: W[:, k] *= w[k]) and give the norms unit
        weights. The model computes the same function, the folded weights rounded once to
        their dtype; decode batches on GEMMs then need no norm kernels
        (`cleave.model.fused_decode`). The final norm is kept (lm_head may be tied to the embeddings).
        Idempotent; a model without the fused decode layouts (MoE, sinks) is left as it is."""
        if self.norms_folded or not self.has_fused_decode_layouts:
            return self
        for layer in self.layers:
            for norm, projection in (
                (layer.input_layernorm, layer.self_attn.qkv_proj),
                (layer.post_attention_layernorm, layer.mlp.gate_up_proj),
            ):
                weight = projection.weight
                for start in range(0, weight.shape[0], 4096):  # bounded fp32 scratch
                    rows = weight[start : start + 4096]
                    rows.copy_(rows.float() * norm.weight.float())
                norm.weight.fill_(1.0)
        self.norms_folded = True
        return self

    def set_impl(self, impl: Impl, attention_impl: Impl | None = None) -> "CausalLM":
        """Pick the kernel side ("auto", "triton", "torch") of every op; attention may differ."""
        for module in self.modules():
            if hasattr(module, "impl"):
                module.impl = impl
            if isinstance(module, Attention):
                module.attention_impl = attention_impl or impl
        return self

    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        kv_cache: torch.Tensor,  # [num_layers or num_slots, 2, num_blocks, block_size, Hkv, D]
        metadata: AttentionMetadata,
    ) -> torch.Tensor:  # [T, H]
        hidden = self.embed(input_ids)  # [T, H]
        layer_kv = self.layer_kv(kv_cache, metadata)
        if run_fused_decode(self, hidden, positions, layer_kv, metadata):  # hidden: the residual stream
            return self.norm(hidden)
        residual: torch.Tensor | None = None
        for layer, (cache, layer_metadata) in zip(self.layers, layer_kv):
            hidden, residual = layer(hidden, residual, positions, cache, layer_metadata, self.cos_sin_cache)
        hidden, _ = self.norm(hidden, residual)
        return hidden

    def layer_kv(self, kv_cache: torch.Tensor, metadata: AttentionMetadata) -> list[tuple[torch.Tensor, AttentionMetadata]]:
        """Each layer's cache slot and the metadata over its tables: a slot per layer, or the
        paired plan (`self.paired_kv`) for a cache of fewer slots, whose window layers read
        `metadata.window`."""
        num_layers = len(self.layers)
        if kv_cache.shape[0] == num_layers:
            return [(kv_cache[index], metadata) for index in range(num_layers)]
        plan = self.paired_kv
        if not plan.is_paired or kv_cache.shape[0] != plan.num_slots:
            raise ValueError(f"a KV cache of {kv_cache.shape[0]} layer slots for {num_layers} layers; "
                             f"allocate_kv_cache gives one per layer, or {plan.num_slots} paired")
        window = metadata.window
        if window is None:
            raise ValueError("a paired KV cache needs metadata.window (the batch over the window tables)")
        return [(kv_cache[slot], window if reads_window else metadata) for slot, reads_window in plan.layers()]

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[T] token ids -> [T, H] embeddings."""
        return embedding(input_ids, self.embed_tokens.weight, impl=self.impl, pdl=self.pdl)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # hidden: [N, H] -> [N, V] float32
        if 0 < hidden.shape[0] <= GEMV_AUTO_MAX_ROWS and hidden.is_cuda and use_triton(hidden, self.impl):
            # the register GEMV beats cuBLAS here, and writes the bf16-rounded logits as fp32
            return small_linear(hidden, self.lm_head.weight, out_dtype=torch.float32, pdl=self.pdl)
        if hidden.is_cuda and hidden.dtype in (torch.bfloat16, torch.float16) and hidden.dim() == 2:
            # fp32 straight out of the GEMM's accumulator: no [N, V] cast pass after it
            return torch.mm(hidden, self.lm_head.weight.t(), out_dtype=torch.float32)
        return self.lm_head(hidden).float()


def allocate_kv_cache(
    config: ModelConfig,
    num_blocks: int,
    block_size: int,
    dtype: torch.dtype | None = None,
    device: torch.device | str = "cpu",
    num_slots: int | None = None,
) -> torch.Tensor:
    """Zeroed [num_slots, 2, num_blocks, block_size, Hkv, D] cache (dtype defaults to the
    model's; `num_slots` to one per layer, fewer for a paired plan: cleave.kv.groups)."""
    shape = (
        num_slots or config.num_hidden_layers,
        2,
        num_blocks,
        block_size,
        config.num_key_value_heads,
        config.head_dim,
    )
    return torch.zeros(shape, dtype=dtype or config.dtype, device=device)
