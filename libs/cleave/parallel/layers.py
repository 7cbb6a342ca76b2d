"""The layers whose outputs cross ranks: a row-parallel Linear (partial products summed) and
a vocab-parallel embedding (each rank embeds its own token ids, the rows summed).

Column-parallel projections (qkv_proj, gate_up_proj) and the lm_head need no layer of their
own: they are plain `nn.Linear`s holding the rank's output rows (`cleave.parallel.sharding`),
and the logits are gathered by `TensorParallelCausalLM.compute_logits`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from cleave.kernels.dispatch import Impl
from cleave.kernels.embedding import embedding
from cleave.parallel.group import TensorParallelGroup


class RowParallelLinear(nn.Linear):
    """y = sum over ranks of x_r W_r^T, + bias: each rank holds the weight columns of its
    slice of the input (`x_r`, the output of the column-parallel projection before it), so
    one all-reduce per call completes the product. The bias, whole on every rank, is added
    once after the sum."""

    def __init__(self, in_features: int, out_features: int, bias: bool, group: TensorParallelGroup) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, in / R] -> [T, out], identical on every rank
        out = self.group.all_reduce(F.linear(x, self.weight))
        return out if self.bias is None else out + self.bias


class VocabParallelEmbedding(nn.Module):
    """Token embeddings of one vocabulary shard: ids in [vocab_start, vocab_start + rows)
    take their row here, every other id a zero row, and one all-reduce sums the shards so
    every rank ends with every token's embedding. `weight` [rows, H] may carry zero padding
    rows past the vocabulary's end (no id reaches them)."""

    def __init__(
        self, num_rows: int, hidden_size: int, vocab_start: int, group: TensorParallelGroup,
        impl: Impl = "auto", pdl: bool = True,
    ) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_rows, hidden_size))
        self.vocab_start = vocab_start
        self.group = group
        self.impl: Impl = impl
        self.pdl = pdl

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        # input_ids: [T] -> [T, H]
        local_ids = input_ids - self.vocab_start
        in_shard = (local_ids >= 0) & (local_ids < self.weight.shape[0])  # [T]
        hidden = embedding(torch.where(in_shard, local_ids, 0), self.weight, impl=self.impl, pdl=self.pdl)
        hidden.masked_fill_(~in_shard.unsqueeze(-1), 0.0)
        return self.group.all_reduce(hidden)
