"""Top-k routing of one token's router logits, as a `triton.jit` helper shared by the kernels.

`fused_moe._route_kernel` (a launch of its own, before the grouped GEMMs),
`moe_gemv._gate_up_kernel` (each program routes its token itself, so the per-entry GEMVs
need no routing launch) and `moe_router._router_route_kernel` (the router GEMV's last
program routes) all call `top_k_routing`: given the same logits they choose the same experts
with the same weights, ties included. It lives apart from the kernels' modules because
`fused_moe` imports `moe_gemv`.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def store_routing(weights, ids, out_weights_row, out_ids_row, TOP_K: tl.constexpr, BLOCK_K: tl.constexpr):
    """Write one token's routing (`top_k_routing`'s outputs) to its [TOP_K] rows."""
    slots = tl.arange(0, BLOCK_K)
    tl.store(out_weights_row + slots, weights, mask=slots < TOP_K)
    tl.store(out_ids_row + slots, ids, mask=slots < TOP_K)


@triton.jit
def top_k_routing(
    logits_row_ptr,  # [E] one token's router logits (any float dtype)
    num_experts,
    TOP_K: tl.constexpr,
    BLOCK_K: tl.constexpr,  # next power of two >= TOP_K
    BLOCK_E: tl.constexpr,  # next power of two >= num_experts
    RENORMALIZE: tl.constexpr,
):
    """(weights [BLOCK_K] fp32, ids [BLOCK_K] int32) of the token's TOP_K experts, in
    descending order of probability: softmax over the logits in fp32, then TOP_K rounds of
    max (ties: the lower expert id), divided by their sum when RENORMALIZE (which equals a
    softmax over the top-k logits, gpt-oss's router). Slots past TOP_K hold 0.

    Each round is one reduction: an expert's key is its probability's bits (non-negative
    floats order as their bit patterns) above BLOCK_E - 1 - id, so the largest key is the
    most probable expert and, among equals, the lowest id."""
    experts = tl.arange(0, BLOCK_E)
    valid = experts < num_experts
    logits = tl.load(logits_row_ptr + experts, mask=valid, other=float("-inf")).to(tl.float32)
    exps = tl.where(valid, tl.exp(logits - tl.max(logits, axis=0)), 0.0)
    probs = exps / tl.sum(exps, axis=0)  # [E], >= 0
    bits = probs.to(tl.int32, bitcast=True).to(tl.int64)
    keys = tl.where(valid, (bits << 32) | (BLOCK_E - 1 - experts).to(tl.int64), -1)
    slots = tl.arange(0, BLOCK_K)
    chosen_weights = tl.zeros([BLOCK_K], dtype=tl.float32)
    chosen_ids = tl.zeros([BLOCK_K], dtype=tl.int32)
    for slot in tl.static_range(TOP_K):
        best = tl.max(keys, axis=0)
        best_id = (BLOCK_E - 1 - (best & 0xFFFFFFFF)).to(tl.int32)
        best_prob = (best >> 32).to(tl.int32).to(tl.float32, bitcast=True)
        chosen_weights = tl.where(slots == slot, best_prob, chosen_weights)
        chosen_ids = tl.where(slots == slot, best_id, chosen_ids)
        keys = tl.where(keys == best, -1, keys)
    if RENORMALIZE:
        chosen_weights = chosen_weights / tl.sum(chosen_weights, axis=0)
    return chosen_weights, chosen_ids


def routing_blocks(num_experts: int, top_k: int) -> tuple[int, int]:
    """(BLOCK_K, BLOCK_E) of `top_k_routing` for `top_k` of `num_experts` experts; refuses a
    `top_k` outside 1..num_experts (the top-k rounds would pick a masked expert)."""
    if not 0 < top_k <= num_experts:
        raise ValueError(f"top_k must be in 1..{num_experts}, got {top_k}")
    return triton.next_power_of_2(top_k), triton.next_power_of_2(num_experts)
