"""`TensorParallelLayout`: which part of a Llama-family model (dense or mixture-of-experts)
each rank holds, and which slice of each checkpoint tensor that part is read from.

Megatron-style split of a decoder layer over R ranks (H hidden, D head_dim, I intermediate,
V vocab, E experts; HF weights are [out, in]):

    q_proj [Hq D, H]       rows: rank r's Hq/R query heads                 (column-parallel)
    k_proj, v_proj [Hkv D, H]  rows: the KV heads those query heads read  (column-parallel)
    o_proj [H, Hq D]       columns: the same query heads; outputs summed,
                           its bias added once after the sum               (row-parallel)
    sinks [Hq]             the same query heads (gpt-oss)
    gate_proj, up_proj [I, H]  rows: I/R of the intermediate width         (column-parallel)
    down_proj [H, I]       columns: the same I/R; outputs summed           (row-parallel)
    experts (MoE layers)   E/R whole experts, rank r's the r-th contiguous run
                           (expert-parallel: tokens travel to their experts,
                           `cleave.parallel.experts`)
    router                 whole on every rank
    embed_tokens, lm_head [V, H]  rows: ceil(V/R) of the vocabulary, the last rank's
                           zero-padded to that size                        (vocab-parallel)
    norms, q/k norms       whole on every rank

KV heads: with Hkv >= R each rank holds Hkv/R of them; with fewer KV heads than ranks each
KV head is replicated on R/Hkv ranks, and each rank holds the one its query heads use.
A rank's KV cache is therefore [L, 2, blocks, block_size, Hkv_rank, D] with
Hkv_rank = max(1, Hkv/R) (`rank_config`).

Experts are read per rank as the checkpoint stores them: Qwen3-MoE's per-expert tensors
(`experts.{e}.gate_proj.weight`, ...) only for the rank's experts (`holds`), gpt-oss's
stacked `[E, ...]` tensors (dequantised or MXFP4 `_blocks` / `_scales`) as a slice of their
first dimension (`shard_of`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

from cleave.model.config import ModelConfig

_LAYER_PROJECTION = re.compile(r"layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(?:gate|up|down)_proj)\.(weight|bias)")
_SINKS = re.compile(r"layers\.\d+\.self_attn\.sinks")
# stacked [E, ...] expert tensors: gpt-oss's (dequantised, or MXFP4 blocks and scales) and
# transformers' in-memory Qwen3-MoE layout
_STACKED_EXPERTS = re.compile(r"layers\.\d+\.mlp\.experts\.(?:gate_up|down)_proj(?:_bias|_blocks|_scales)?")
_ONE_EXPERT = re.compile(r"layers\.\d+\.mlp\.experts\.(\d+)\..+")  # Qwen3-MoE's per-expert tensors


@dataclass(frozen=True)
class TensorShard:
    """The part of one checkpoint tensor a rank reads: `start:end` along `dim` of a tensor
    whose full size there is `full_size`, then zero-padded to `padded_size` along `dim`
    (the vocabulary's last shard; equal to end - start elsewhere)."""

    dim: int
    start: int
    end: int
    full_size: int
    padded_size: int

    @property
    def num_padding(self) -> int:
        return self.padded_size - (self.end - self.start)


@dataclass(frozen=True)
class TensorParallelLayout:
    """The shard of `config`'s model that rank `rank` of `world_size` holds.

    Raises ValueError (naming the fix) for a model this split does not cover: head counts,
    widths or expert counts that the ranks do not divide.
    """

    config: ModelConfig
    rank: int
    world_size: int

    def __post_init__(self) -> None:
        config, size = self.config, self.world_size
        if not 0 <= self.rank < size:
            raise ValueError(f"rank {self.rank} is outside a tensor-parallel group of {size}")
        has_dense_mlp = len(config.moe_layers) < config.num_hidden_layers
        split_sizes = ["num_attention_heads", *(["intermediate_size"] if has_dense_mlp else [])]
        for name in split_sizes:
            if getattr(config, name) % size:
                raise ValueError(
                    f"{name} ({getattr(config, name)}) is not divisible by tensor_parallel_size ({size}); "
                    "choose a size that divides it"
                )
        if config.is_moe and config.num_experts % size:
            raise ValueError(
                f"num_experts ({config.num_experts}) is not divisible by tensor_parallel_size ({size}): each rank "
                "holds an equal run of whole experts; choose a tensor_parallel_size that divides num_experts"
            )
        num_kv_heads = config.num_key_value_heads
        if num_kv_heads % size and size % num_kv_heads:
            raise ValueError(
                f"num_key_value_heads ({num_kv_heads}) and tensor_parallel_size ({size}) must divide one "
                "another (KV heads are split across ranks, or replicated when there are fewer than ranks)"
            )

    # ---- sizes of this rank's shard -------------------------------------------------------

    @property
    def num_heads(self) -> int:
        """Query heads on this rank."""
        return self.config.num_attention_heads // self.world_size

    @property
    def num_kv_heads(self) -> int:
        """KV heads on this rank (1, a replica, when the model has fewer KV heads than ranks)."""
        return max(1, self.config.num_key_value_heads // self.world_size)

    @property
    def first_head(self) -> int:
        """The first of this rank's query heads."""
        return self.rank * self.num_heads

    @property
    def first_kv_head(self) -> int:
        """The first of this rank's KV heads: the one its first query head reads."""
        queries_per_kv_head = self.config.num_attention_heads // self.config.num_key_value_heads
        return self.first_head // queries_per_kv_head

    @property
    def intermediate_size(self) -> int:
        return self.config.intermediate_size // self.world_size

    @property
    def num_local_experts(self) -> int:
        """Experts of each MoE layer on this rank (0 for a dense model)."""
        return self.config.num_experts // self.world_size if self.config.is_moe else 0

    @property
    def first_expert(self) -> int:
        """The first of this rank's experts (the rest follow it contiguously)."""
        return self.rank * self.num_local_experts

    @property
    def vocab_shard_size(self) -> int:
        """Rows of every rank's embedding and lm_head (the last rank's padded with zeros)."""
        return -(-self.config.vocab_size // self.world_size)

    @property
    def vocab_start(self) -> int:
        """The first token id this rank embeds and scores."""
        return self.rank * self.vocab_shard_size

    @property
    def vocab_end(self) -> int:
        """One past the last real token id of this rank's rows (rows past it are padding)."""
        return max(self.vocab_start, min(self.config.vocab_size, self.vocab_start + self.vocab_shard_size))

    def rank_config(self) -> ModelConfig:
        """`config` as this rank computes it: its query heads, KV heads and intermediate
        width, so the decoder layers and the KV cache built from it have the rank's shapes.
        vocab_size stays the full vocabulary: it is the width of the gathered logits; and
        num_experts stays the model's: the router, whole on every rank, scores them all."""
        return replace(
            self.config,
            num_attention_heads=self.num_heads,
            num_key_value_heads=self.num_kv_heads,
            intermediate_size=self.intermediate_size,
        )

    # ---- checkpoint slices ----------------------------------------------------------------

    def holds(self, hf_name: str) -> bool:
        """Whether this rank reads HF tensor `hf_name` at all: False only for another rank's
        experts stored one expert per tensor (Qwen3-MoE)."""
        match = _ONE_EXPERT.fullmatch(hf_name.removeprefix("model."))
        return match is None or self.first_expert <= int(match.group(1)) < self.first_expert + self.num_local_experts

    def shard_of(self, hf_name: str) -> TensorShard | None:
        """The slice of HF tensor `hf_name` this rank holds; None when every rank holds it whole."""
        config, head_dim = self.config, self.config.head_dim
        name = hf_name.removeprefix("model.")
        if name in ("embed_tokens.weight", "lm_head.weight"):
            return TensorShard(0, self.vocab_start, self.vocab_end, config.vocab_size, self.vocab_shard_size)
        if _SINKS.fullmatch(name):
            return _rows(0, self.first_head, self.first_head + self.num_heads, config.num_attention_heads)
        if _STACKED_EXPERTS.fullmatch(name):
            return _rows(0, self.first_expert, self.first_expert + self.num_local_experts, config.num_experts)
        match = _LAYER_PROJECTION.fullmatch(name)
        if match is None:
            return None
        projection, kind = match.groups()
        q_heads = (self.first_head * head_dim, (self.first_head + self.num_heads) * head_dim, config.q_size)
        kv_heads = (self.first_kv_head * head_dim, (self.first_kv_head + self.num_kv_heads) * head_dim, config.kv_size)
        inter = (self.rank * self.intermediate_size, (self.rank + 1) * self.intermediate_size, config.intermediate_size)
        if projection == "self_attn.q_proj":
            return _rows(0, *q_heads)
        if projection in ("self_attn.k_proj", "self_attn.v_proj"):
            return _rows(0, *kv_heads)
        if projection in ("mlp.gate_proj", "mlp.up_proj"):
            return _rows(0, *inter)
        # row-parallel: weights split along their input; a bias is added once, after the sum
        if kind == "bias":
            return None
        return _rows(1, *(q_heads if projection == "self_attn.o_proj" else inter))


def _rows(dim: int, start: int, end: int, full_size: int) -> TensorShard:
    return TensorShard(dim, start, end, full_size, end - start)
