"""`TensorParallelCausalLM`: `cleave.model.llama.CausalLM` split over the ranks of a
`TensorParallelGroup`, the model file's maths unchanged.

Per rank, a step goes: token ids (every rank gets all of them) -> vocab-parallel embedding
(one all-reduce) -> per layer: norm, qkv_proj of the rank's heads, attention over the rank's
KV heads in its own cache (with their sinks, gpt-oss), row-parallel o_proj (one all-reduce),
norm, then either gate_up_proj of the rank's intermediate slice and row-parallel down_proj
(one all-reduce), or in an MoE layer the expert-parallel block (the rank's slice of the
tokens routed to the ranks holding their experts and back, then all-gathered:
`cleave.parallel.experts`) -> final norm -> logits of the rank's vocabulary rows, gathered
to [N, V] on every rank. Hidden states between layers are whole and identical on every
rank, so each rank samples the same tokens from the same logits and the engines stay in step.

The fused decode layouts (`cleave.model.fused_decode`) add the o and down projections into
the residual inside their kernels, before any sum across ranks, so this model runs its own
layers on every batch (`has_fused_decode_layouts` and `has_gemv_decode_layout` are False).
"""

from __future__ import annotations

import torch
from torch import nn

from cleave.kernels.dispatch import Impl
from cleave.model.config import ModelConfig
from cleave.model.llama import CausalLM
from cleave.parallel.experts import ExpertParallelMoeBlock
from cleave.parallel.group import TensorParallelGroup
from cleave.parallel.layers import RowParallelLinear, VocabParallelEmbedding
from cleave.parallel.sharding import TensorParallelLayout


class TensorParallelCausalLM(CausalLM):
    """One rank's shard of a Llama-family `CausalLM`, dense or mixture-of-experts (build it
    on the meta device, as `cleave.model.loader.empty_model` does, then load its shard).

    `config` is the rank's view (`TensorParallelLayout.rank_config`): query heads, KV heads
    and intermediate width are this rank's share, which is what its projections and KV
    cache hold; vocab_size stays the full vocabulary, the width of the gathered logits.
    `layout` keeps the checkpoint's config and says which shard this is.
    """

    def __init__(self, config: ModelConfig, group: TensorParallelGroup, impl: Impl = "auto", pdl: bool = True) -> None:
        layout = TensorParallelLayout(config, group.rank, group.world_size)
        super().__init__(layout.rank_config(), impl, pdl)
        self.layout = layout
        self.group = group
        self.has_fused_decode_layouts = False
        self.has_gemv_decode_layout = False
        hidden = config.hidden_size
        self.embed_tokens = VocabParallelEmbedding(layout.vocab_shard_size, hidden, layout.vocab_start, group, impl, pdl)
        self.lm_head = nn.Linear(hidden, layout.vocab_shard_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        for index, layer in enumerate(self.layers):
            attention = layer.self_attn
            attention.o_proj = RowParallelLinear(attention.q_size, hidden, config.o_proj_bias, group)
            if index in config.moe_layers:
                layer.mlp = ExpertParallelMoeBlock(config, layout, group, impl)
            else:
                layer.mlp.down_proj = RowParallelLinear(layout.intermediate_size, hidden, False, group)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[T] token ids (all of them on every rank) -> [T, H], identical on every rank."""
        return self.embed_tokens(input_ids)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # hidden: [N, H] -> this rank's [N, V_shard] -> gathered [N, R V_shard] -> [N, V] float32
        logits = self.group.all_gather(super().compute_logits(hidden), dim=-1)
        vocab_size = self.config.vocab_size
        return logits if logits.shape[-1] == vocab_size else logits[:, :vocab_size].contiguous()
