"""`TensorParallelLayout`: which part of a dense Llama-family model each rank holds, and
which slice of each checkpoint tensor that part is read from.

Megatron-style split of a decoder layer over R ranks (H hidden, D head_dim, I intermediate,
V vocab; HF weights are [out, in]):

    q_proj [Hq D, H]       rows: rank r's Hq/R query heads                 (column-parallel)
    k_proj, v_proj [Hkv D, H]  rows: the KV heads those query heads read  (column-parallel)
    o_proj [H, Hq D]       columns: the same query heads; outputs summed   (row-parallel)
    gate_proj, up_proj [I, H]  rows: I/R of the intermediate width         (column-parallel)
    down_proj [H, I]       columns: the same I/R; outputs summed           (row-parallel)
    embed_tokens, lm_head [V, H]  rows: ceil(V/R) of the vocabulary, the last rank's
                           zero-padded to that size                        (vocab-parallel)
    norms, q/k norms       whole on every rank

KV heads: with Hkv >= R each rank holds Hkv/R of them; with fewer KV heads than ranks each
KV head is replicated on R/Hkv ranks, and each rank holds the one its query heads use.
A rank's KV cache is therefore [L, 2, blocks, block_size, Hkv_rank, D] with
Hkv_rank = max(1, Hkv/R) (`rank_config`). Mixture-of-experts layers and attention sinks
are not split here (expert parallelism is a separate layout).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

from cleave.model.config import ModelConfig

_LAYER_PROJECTION = re.compile(r"layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(?:gate|up|down)_proj)\.(weight|bias)")


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

    Raises ValueError (naming the fix) for a model this split does not cover: MoE layers,
    attention sinks, or head counts and widths that the ranks do not divide.
    """

    config: ModelConfig
    rank: int
    world_size: int

    def __post_init__(self) -> None:
        config, size = self.config, self.world_size
        if not 0 <= self.rank < size:
            raise ValueError(f"rank {self.rank} is outside a tensor-parallel group of {size}")
        if config.is_moe or config.attention_sinks:
            raise ValueError(
                f"tensor parallelism covers dense Llama-family models; {config.architecture} has "
                f"{'mixture-of-experts layers' if config.is_moe else 'attention sinks'}: run it with tensor_parallel_size=1"
            )
        for name in ("num_attention_heads", "intermediate_size"):
            if getattr(config, name) % size:
                raise ValueError(
                    f"{name} ({getattr(config, name)}) is not divisible by tensor_parallel_size ({size}); "
                    "choose a size that divides it"
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
        vocab_size stays the full vocabulary: it is the width of the gathered logits."""
        return replace(
            self.config,
            num_attention_heads=self.num_heads,
            num_key_value_heads=self.num_kv_heads,
            intermediate_size=self.intermediate_size,
        )

    # ---- checkpoint slices ----------------------------------------------------------------

    def shard_of(self, hf_name: str) -> TensorShard | None:
        """The slice of HF tensor `hf_name` this rank holds; None when every rank holds it whole."""
        config, head_dim = self.config, self.config.head_dim
        name = hf_name.removeprefix("model.")
        if name in ("embed_tokens.weight", "lm_head.weight"):
            return TensorShard(0, self.vocab_start, self.vocab_end, config.vocab_size, self.vocab_shard_size)
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
