"""Sparse mixture-of-experts feed-forward block (Qwen3-MoE, gpt-oss).

A router Linear scores every expert per token; `cleave.kernels.fused_moe` picks the top-k,
runs each token through its experts' SwiGLU MLPs and sums them by routing weight. Expert
weights are stacked per layer in one layout whatever the checkpoint's (the loader converts):
`w13` [E, 2I, H] is each expert's gate rows then its up rows, `w2` [E, H, I] its down
projection, with optional biases `w13_bias` [E, 2I] and `w2_bias` [E, H].
"""

from __future__ import annotations

import torch
from torch import nn

from cleave.kernels.dispatch import Impl
from cleave.kernels.fused_moe import fused_moe, variant_token_counts
from cleave.kernels.moe_reference import MoEActivation
from cleave.kernels.mxfp4 import MXFP4Weight
from cleave.model.config import ModelConfig
from cleave.model.projection import project


class Experts(nn.Module):
    """The stacked weights of one layer's experts: all `config.num_experts` of them, or
    `num_experts` (an expert-parallel rank's share, `cleave.parallel.experts`).

    With `config.packed_experts` the weights stay MXFP4 as the checkpoint ships them:
    `w13_blocks` / `w13_scales` and `w2_blocks` / `w2_scales` (uint8) instead of `w13` and
    `w2`. The kernels take either through `gate_up` and `down`."""

    def __init__(self, config: ModelConfig, num_experts: int | None = None) -> None:
        super().__init__()
        num_experts = config.num_experts if num_experts is None else num_experts
        hidden, inter = config.hidden_size, config.moe_intermediate_size
        self.packed = config.packed_experts
        if self.packed:
            def packed(rows: int, columns: int) -> nn.Parameter:
                return nn.Parameter(torch.empty(num_experts, rows, columns, dtype=torch.uint8), requires_grad=False)

            self.w13_blocks, self.w13_scales = packed(2 * inter, hidden // 2), packed(2 * inter, hidden // 32)
            self.w2_blocks, self.w2_scales = packed(hidden, inter // 2), packed(hidden, inter // 32)
        else:
            self.w13 = nn.Parameter(torch.empty(num_experts, 2 * inter, hidden))
            self.w2 = nn.Parameter(torch.empty(num_experts, hidden, inter))
        if config.expert_bias:
            self.w13_bias = nn.Parameter(torch.empty(num_experts, 2 * inter))
            self.w2_bias = nn.Parameter(torch.empty(num_experts, hidden))
        else:
            self.w13_bias = self.w2_bias = None

    @property
    def gate_up(self) -> torch.Tensor | MXFP4Weight:
        """[E, 2I, H]: each expert's gate rows, then its up rows."""
        return MXFP4Weight(self.w13_blocks, self.w13_scales) if self.packed else self.w13

    @property
    def down(self) -> torch.Tensor | MXFP4Weight:
        """[E, H, I]"""
        return MXFP4Weight(self.w2_blocks, self.w2_scales) if self.packed else self.w2


class SparseMoeBlock(nn.Module):
    """x -> sum over the top-k experts of weight_k * down_k(act(gate_k(x), up_k(x)))."""

    def __init__(self, config: ModelConfig, impl: Impl = "auto") -> None:
        super().__init__()
        self.impl: Impl = impl
        self.top_k = config.num_experts_per_tok
        self.renormalize = config.norm_topk_prob
        if config.swiglu_limit is None:
            self.activation = MoEActivation("silu")
        else:
            self.activation = MoEActivation("swiglu_clamped", alpha=config.swiglu_alpha, limit=config.swiglu_limit)
        self.router = nn.Linear(config.hidden_size, config.num_experts, bias=config.router_bias)
        self.experts = Experts(config)
        # the GEMV decode layout (cleave.model.fused_decode) routes in the first expert GEMV
        # instead of a launch of its own; off: slower for Qwen3-30B-A3B's 128 experts
        self.route_in_gemv = False
        # the GEMV decode layout's single-token router GEMV routes in its last program instead
        # of a routing launch (`cleave.kernels.moe_router`); off: on an H100 slower for
        # Qwen3-30B-A3B (2711 vs 2619 us a step), faster for gpt-oss-20b (2995 vs 3021;
        # bench/results/moe/moe-decode-20261206T191132Z.md, ...191149Z.md)
        self.route_in_router = False
        self.router_tiles: tuple[int, int] | None = None  # its (BLOCK_N, num_warps); None: moe_router.DEFAULT_TILES

    @torch.inference_mode()
    def warm_variants(self, max_tokens: int) -> int:
        """Run this block once over zeros at each token count `variant_token_counts` lists for
        1..`max_tokens` tokens, so that no prefill or mixed step of up to that many tokens meets
        an expert-kernel variant still to compile (each compile stalls its step 0.3-1.3 s).
        Returns the counts run."""
        weight, gate_up = self.router.weight, self.experts.gate_up
        num_experts, inter2, hidden = gate_up.shape
        counts = variant_token_counts(max_tokens, self.top_k, num_experts, inter2 // 2, hidden, weight,
                                      mxfp4=isinstance(gate_up, MXFP4Weight))
        for num_tokens in counts:
            self(torch.zeros(num_tokens, hidden, dtype=weight.dtype, device=weight.device))
        return len(counts)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        # hidden: [T, H] -> [T, H]
        router_logits = project(self.router, hidden, self.impl)  # [T, E]
        experts = self.experts
        return fused_moe(
            hidden, experts.gate_up, experts.down, router_logits, self.top_k, self.renormalize, self.activation,
            experts.w13_bias, experts.w2_bias, impl=self.impl,
        )
