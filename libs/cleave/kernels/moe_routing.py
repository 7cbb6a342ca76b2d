"""Top-k routing of one token's router logits, as a `triton.jit` helper shared by the kernels.

`fused_moe._route_kernel` (a launch of its own, before the grouped GEMMs),
`moe_gemv._gate_up_kernel` (each program routes its token itself, so the per-entry GEMVs
need no routing launch) and `moe_router._router_route_kernel` (the router GEMV's last
program routes) all call `top_k_routing`: given the same logits they choose the same experts
with the same weights, ties included. It lives apart from both kernels' modules because
`fused_moe` imports `moe_gemv`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from cleave.kernels.pdl import hopper_or_later


# One bulk prefetch moves at most this much: sm_90 code carries its size in 16-byte units in
# 16 bits.
MAX_BULK_PREFETCH_BYTES = 16 * 0xFFFF


@dataclass(frozen=True)
class ExpertPrefetch:
    """The leading `rows` of each half of the chosen experts' gate_up weight, which the
    routing kernel pulls into L2 (`cp.async.bulk.prefetch.L2`, one instruction a range) as
    soon as it has chosen them: the rows the per-entry gate_up GEMV's first programs read
    (its grid is entry-fastest, program (entry, b) owning features [b B, (b + 1) B) of both
    halves), whose weight stream would otherwise start only once the routing is written and
    read back after that kernel's wait."""

    gate_up: torch.Tensor  # [E, 2N, K], contiguous along K
    rows: int  # per half, 1..N

    def __post_init__(self) -> None:
        if self.gate_up.dim() != 3 or self.gate_up.stride(-1) != 1:
            raise ValueError(f"ExpertPrefetch needs a [E, 2N, K] gate_up contiguous along K, got "
                             f"{tuple(self.gate_up.shape)} with strides {tuple(self.gate_up.stride())}")
        half = self.gate_up.shape[1] // 2
        if not 0 < self.rows <= half:
            raise ValueError(f"ExpertPrefetch rows must be in 1..{half}, got {self.rows}")
        if self.range_bytes % 16 or self.range_bytes > MAX_BULK_PREFETCH_BYTES:
            raise ValueError(f"ExpertPrefetch ranges must be a multiple of 16 bytes up to {MAX_BULK_PREFETCH_BYTES}, "
                             f"got {self.rows} rows of {self.range_bytes // self.rows} bytes")

    @property
    def range_bytes(self) -> int:
        """Bytes of one prefetched range: `rows` rows of one half of one expert."""
        return self.rows * self.gate_up.stride(1) * self.gate_up.element_size()

    def launch_args(self, like: torch.Tensor) -> tuple[torch.Tensor, int, int, int, bool]:
        """(weight, expert stride, up-half offset, bytes a range: in bytes; PREFETCH) for the
        routing kernel; off (PREFETCH False) before Hopper and on CPU tensors."""
        weight = self.gate_up
        if not hopper_or_later(like):
            return like, 0, 0, 0, False
        size = weight.element_size()
        return (weight, weight.stride(0) * size, weight.shape[1] // 2 * weight.stride(1) * size, self.range_bytes,
                True)


@triton.jit
def prefetch_expert_rows(w_ptr, ids, stride_expert, up_offset, num_bytes):
    """Bulk-prefetch `num_bytes` (a multiple of 16) from the start of each half of every
    expert in `ids` into L2 (strides and offset in bytes)."""
    gate = w_ptr.to(tl.pointer_type(tl.int8)) + ids.to(tl.int64) * stride_expert
    sizes = tl.full(ids.shape, 0, tl.int32) + num_bytes
    for half in tl.static_range(2):
        tl.inline_asm_elementwise("cp.async.bulk.prefetch.L2.global [$1], $2;\n\tmov.u32 $0, 0;", "=r,l,r",
                                  [gate + half * up_offset, sizes], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def store_routing(weights, ids, out_weights_row, out_ids_row, prefetch_w_ptr, prefetch_stride_expert,
                  prefetch_up_offset, prefetch_bytes, TOP_K: tl.constexpr, BLOCK_K: tl.constexpr,
                  PREFETCH: tl.constexpr):
    """Write one token's routing (`top_k_routing`'s outputs) to its [TOP_K] rows; with
    PREFETCH the chosen experts' leading gate_up rows are pulled into L2 first
    (`ExpertPrefetch.launch_args` gives the pointer, strides and size), so their weight
    stream starts before the stores."""
    slots = tl.arange(0, BLOCK_K)
    if PREFETCH:
        first = tl.sum(tl.where(slots == 0, ids, 0), axis=0)  # padding slots repeat the first expert
        prefetch_expert_rows(prefetch_w_ptr, tl.where(slots < TOP_K, ids, first), prefetch_stride_expert,
                             prefetch_up_offset, prefetch_bytes)
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
