"""`ExpertParallelMoeBlock`: a sparse MoE layer whose experts are split over the ranks of a
`TensorParallelGroup`, each token sent to the ranks that hold its experts and back.

Every rank enters the layer with the same hidden states [T, H] (attention's output is summed
over the group). A forward on rank r of R, with E experts, k per token, E/R per rank:

    tokens   rank r's contiguous slice of ceil(T/R) rows (the last ranks' may be shorter
             or empty)                                                       [n, H]
    route    whole router, top-k with the model's renormalisation            [n, k] ids, weights
    dispatch the (token, slot) pairs sorted by expert; per-expert counts exchanged (one
             all-to-all of [E] counts), then each pair's row sent to the rank owning its
             expert (one all-to-all)                                          [n k, H] -> [m, H]
    experts  the received rows through the rank's local experts, unweighted  [m, H]
    combine  the results sent back the way they came (one all-to-all), weighted by the
             routing weights in fp32 and summed over the k slots             [n, H]
    gather   every rank's slice, padded to ceil(T/R) rows, all-gathered      [T, H]

The row exchanges have sizes known only once the counts arrive (one device-to-host read per
layer), so this layer runs eagerly: it cannot be captured in a CUDA graph.
"""

from __future__ import annotations

import torch

from cleave.kernels.dispatch import Impl
from cleave.kernels.fused_moe import fused_experts, route
from cleave.model.config import ModelConfig
from cleave.model.moe import Experts, SparseMoeBlock
from cleave.parallel.group import TensorParallelGroup
from cleave.parallel.sharding import TensorParallelLayout


class ExpertParallelMoeBlock(SparseMoeBlock):
    """One rank's part of a `SparseMoeBlock`: the whole router, and `experts` holding the
    rank's `layout.num_local_experts` experts, global ids first_expert.. onwards (local id
    = global id - first_expert). Build it on the meta device, as `TensorParallelCausalLM` is.

    `config` is the checkpoint's (the router scores all `num_experts` experts).
    """

    def __init__(self, config: ModelConfig, layout: TensorParallelLayout, group: TensorParallelGroup,
                 impl: Impl = "auto") -> None:
        super().__init__(config, impl)
        self.experts = Experts(config, num_experts=layout.num_local_experts)
        self.group = group
        self.num_experts = config.num_experts
        self.num_local_experts = layout.num_local_experts

    def warm_variants(self, max_tokens: int) -> int:
        """Nothing: a forward here is an exchange every rank must join, and each rank's experts
        see the token counts the routing sends them, so they compile in the first steps."""
        return 0

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        # hidden: [T, H], identical on every rank -> [T, H], identical on every rank
        if hidden.is_cuda and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                "expert-parallel MoE layers size their exchanges from per-step token counts and cannot be captured "
                "in a CUDA graph; run the engine with enforce_eager=True"
            )
        group = self.group
        num_tokens = hidden.shape[0]
        rows_per_rank = -(-num_tokens // group.world_size)
        start = min(num_tokens, group.rank * rows_per_rank)
        local_hidden = hidden[start : start + rows_per_rank]  # [n, H], n <= rows_per_rank
        local_out = self._local_tokens(local_hidden)  # [n, H]
        padding = rows_per_rank - local_out.shape[0]
        if padding:
            local_out = torch.cat((local_out, local_out.new_zeros(padding, local_out.shape[1])))
        return group.all_gather(local_out, dim=0)[:num_tokens]

    def _local_tokens(self, hidden: torch.Tensor) -> torch.Tensor:
        """This rank's tokens [n, H] through their top-k experts, wherever those live -> [n, H]."""
        group, top_k = self.group, self.top_k
        num_tokens, hidden_size = hidden.shape
        weights, ids = route(self.router(hidden), top_k, self.renormalize, impl=self.impl)  # [n, k] fp32, int32
        # pairs grouped by expert, so by owning rank; a stable sort keeps token order in a group
        expert_of_pair = ids.reshape(-1).long()  # [n k], pair = token * k + slot
        order = torch.sort(expert_of_pair, stable=True).indices  # [n k]
        send_per_expert = torch.bincount(expert_of_pair, minlength=self.num_experts)  # [E]
        recv_per_expert = group.all_to_all_single(send_per_expert)  # [R * E_local]: per source, per local expert
        send_counts = send_per_expert.view(group.world_size, -1).sum(dim=1)
        recv_counts = recv_per_expert.view(group.world_size, -1).sum(dim=1)
        send_list, recv_list = torch.stack((send_counts, recv_counts)).tolist()  # the one host read

        received = group.all_to_all_single(hidden[order // top_k], send_list, recv_list)  # [m, H]
        local_ids = torch.arange(self.num_local_experts, device=hidden.device).repeat(group.world_size)
        local_ids = local_ids.repeat_interleave(recv_per_expert, output_size=received.shape[0])  # [m]
        results = self._run_local_experts(received, local_ids)  # [m, H]
        returned = group.all_to_all_single(results, recv_list, send_list)  # [n k, H], in `order`

        per_pair = torch.empty_like(returned)
        per_pair[order] = returned  # back to token * k + slot
        combined = (per_pair.view(num_tokens, top_k, hidden_size).float() * weights.unsqueeze(-1)).sum(dim=1)
        return combined.to(hidden.dtype)

    def _run_local_experts(self, rows: torch.Tensor, local_ids: torch.Tensor) -> torch.Tensor:
        """Each row [m, H] through its one local expert (`local_ids` [m]), weight 1 -> [m, H]."""
        if rows.shape[0] == 0:
            return rows
        experts = self.experts
        unit_weights = torch.ones(rows.shape[0], 1, dtype=torch.float32, device=rows.device)
        return fused_experts(
            rows, experts.gate_up, experts.down, unit_weights, local_ids.to(torch.int32).unsqueeze(1), self.activation,
            experts.w13_bias, experts.w2_bias, impl=self.impl,
        )
