"""Torch references of the mixture-of-experts ops in `cleave.kernels.fused_moe`.

Expert weights use one layout for every architecture: `w13` [E, 2I, H] holds each expert's
gate rows then its up rows (what the first GEMM reads), `w2` [E, H, I] its down projection;
optional biases are `w13_bias` [E, 2I] and `w2_bias` [E, H]. Routing returns the top-k
expert ids per token and their weights in fp32.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class MoEActivation:
    """The gated activation between an expert's two GEMMs.

    `silu`: silu(gate) * up (Qwen3-MoE). `swiglu_clamped` (gpt-oss): gate clamped above at
    `limit`, up clamped to [-limit, limit], then (up + 1) * gate * sigmoid(alpha * gate).
    """

    kind: Literal["silu", "swiglu_clamped"] = "silu"
    alpha: float = 1.702
    limit: float = 7.0

    def __post_init__(self) -> None:
        if self.kind not in ("silu", "swiglu_clamped"):
            raise ValueError(f"MoE activation must be 'silu' or 'swiglu_clamped', got {self.kind!r}")


SILU = MoEActivation()


def route_reference(
    router_logits: torch.Tensor,  # [T, E]
    top_k: int,
    renormalize: bool,
) -> tuple[torch.Tensor, torch.Tensor]:  # weights [T, k] fp32, ids [T, k] int32
    """Softmax over the experts, the k largest (ties: the lower expert id first), divided
    by their sum when `renormalize` (which equals a softmax over the top-k logits)."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.sort(probs, dim=-1, descending=True, stable=True)
    weights, ids = weights[:, :top_k], ids[:, :top_k]
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids.to(torch.int32)


def gated_activation_reference(gate_up: torch.Tensor, activation: MoEActivation) -> torch.Tensor:
    """[N, 2I] = [gate | up] in fp32 -> [N, I] fp32."""
    gate, up = gate_up.chunk(2, dim=-1)
    if activation.kind == "silu":
        return F.silu(gate) * up
    gate = gate.clamp(max=activation.limit)
    up = up.clamp(min=-activation.limit, max=activation.limit)
    return (up + 1) * gate * torch.sigmoid(gate * activation.alpha)


def fused_experts_reference(
    hidden: torch.Tensor,  # [T, H]
    w13: torch.Tensor,  # [E, 2I, H]
    w2: torch.Tensor,  # [E, H, I]
    topk_weights: torch.Tensor,  # [T, k] fp32
    topk_ids: torch.Tensor,  # [T, k] int
    activation: MoEActivation = SILU,
    w13_bias: torch.Tensor | None = None,  # [E, 2I]
    w2_bias: torch.Tensor | None = None,  # [E, H]
    round_slots: bool = False,
) -> torch.Tensor:  # [T, H]
    """sum_k weight_k * expert_k(x), one expert at a time in fp32; the activation is rounded
    to the input dtype (as the kernels store it) and the sum once at the end. `round_slots`:
    each weighted expert output is rounded to the input dtype before the sum, as the grouped
    kernels store it (`fused_moe.fused_experts` past `moe_gemv.MAX_TOKENS` tokens)."""
    out = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
    for expert in topk_ids.unique().tolist():
        rows, slots = (topk_ids == expert).nonzero(as_tuple=True)
        x = hidden[rows].float()  # [n, H]
        gate_up = x @ w13[expert].float().t()  # [n, 2I]
        if w13_bias is not None:
            gate_up = gate_up + w13_bias[expert].float()
        act = gated_activation_reference(gate_up, activation).to(hidden.dtype).float()  # [n, I]
        y = act @ w2[expert].float().t()  # [n, H]
        if w2_bias is not None:
            y = y + w2_bias[expert].float()
        y = y * topk_weights[rows, slots, None].float()
        out.index_add_(0, rows, y.to(hidden.dtype).float() if round_slots else y)
    return out.to(hidden.dtype)


def fused_moe_reference(
    hidden: torch.Tensor,  # [T, H]
    w13: torch.Tensor,
    w2: torch.Tensor,
    router_logits: torch.Tensor,  # [T, E]
    top_k: int,
    renormalize: bool = True,
    activation: MoEActivation = SILU,
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
    round_slots: bool = False,
) -> torch.Tensor:  # [T, H]
    """Routing then the experts, both on the references."""
    weights, ids = route_reference(router_logits, top_k, renormalize)
    return fused_experts_reference(hidden, w13, w2, weights, ids, activation, w13_bias, w2_bias, round_slots)


def align_block_size_reference(
    topk_ids: torch.Tensor, num_experts: int, block_size: int
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(sorted entry ids, expert id per block, padded length): the flat (token, slot)
    entries grouped by expert in ascending order, each group padded with the sentinel
    `topk_ids.numel()` to a multiple of `block_size` (experts without entries get no block)."""
    flat = topk_ids.reshape(-1).tolist()
    sentinel = len(flat)
    sorted_ids: list[int] = []
    expert_ids: list[int] = []
    for expert in range(num_experts):
        entries = [index for index, value in enumerate(flat) if value == expert]
        if not entries:
            continue
        padded = -(-len(entries) // block_size) * block_size
        sorted_ids += entries + [sentinel] * (padded - len(entries))
        expert_ids += [expert] * (padded // block_size)
    return torch.tensor(sorted_ids, dtype=torch.int32), torch.tensor(expert_ids, dtype=torch.int32), len(sorted_ids)
