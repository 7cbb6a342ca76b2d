"""A mixture-of-experts router GEMV whose last program routes: logits and top-k in one launch.

At batch 1 the router projection ([E, H], a few hundred KiB) and the top-k routing are two
latency-bound launches between the attention block and the expert GEMVs: on an H100 the
Qwen3-30B-A3B step spends 1.6 and 2.1 us a layer on their critical path
(bench/results/decode/decode_profile-20261206T171234Z.md), much of it one kernel waiting for
the other to finish and flush. Here each program computes `BLOCK_N` logits of a token with
the register GEMV's pass (`gemv.gemv_product`: weights loaded before the PDL wait, the
layer's RMSNorm inside), stores them, and counts itself in on the token's int32 counter
(acq_rel, GPU scope, after a barrier: the program's stores are visible to whoever sees the
count). The program that counts last reads the token's logits back and routes them with
`moe_routing.top_k_routing`, the helper the routing launch runs, then zeroes the counter for
the next launch. Programs are one warp each, so the routing's top-k rounds are shuffle
reductions with no barrier, as in the routing launch's one-warp programs.

The logits are rounded to the activations' dtype before they are stored and routed, as the
router projection's output is, so the routing is `route` of the logits this kernel writes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from cleave.kernels.dispatch import CachedLauncher, Impl, use_triton
from cleave.kernels.gemv import gemv_product
from cleave.kernels.moe_reference import route_reference
from cleave.kernels.moe_routing import routing_blocks, store_routing, top_k_routing
from cleave.kernels.pdl import launch_options, pdl_enabled
from cleave.kernels.small_linear import small_linear_reference

BLOCK_K_MAX = 2048  # K tile of the router GEMV's pass (`gemv.gemv_product`)
# (BLOCK_N, num_warps) of `router_route` by default: one weight row a program over one warp, so
# the last program's top-k rounds are shuffle reductions with no barrier
DEFAULT_TILES = (1, 1)


@triton.jit
def _router_route_kernel(
    x_ptr,  # [T, K] (NORM: the residual stream)
    w_ptr,  # [E, K] router weight
    norm_w_ptr,  # NORM: [K] RMSNorm weight
    bias_ptr,  # BIAS: [E]
    logits_ptr,  # [T, E] out, the activations' dtype
    out_weights_ptr,  # [T, TOP_K] fp32 out
    out_ids_ptr,  # [T, TOP_K] int32 out
    counters_ptr,  # [>= T] int32, zero between launches (zero again after this one)
    num_experts,
    num_in,
    stride_x_row,
    stride_w_row,
    eps,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    K_TILES: tl.constexpr,
    NORM: tl.constexpr,
    BIAS: tl.constexpr,
    TOP_K: tl.constexpr,
    BLOCK_TOPK: tl.constexpr,  # next power of two >= TOP_K
    BLOCK_E: tl.constexpr,  # next power of two >= num_experts
    RENORMALIZE: tl.constexpr,
    PDL: tl.constexpr,
):
    # grid (feature blocks, tokens)
    row = tl.program_id(1).to(tl.int64)
    features = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    feature_valid = features < num_experts
    cols = tl.arange(0, BLOCK_K)
    w_rows = w_ptr + features.to(tl.int64)[:, None] * stride_w_row + cols[None, :]  # [BLOCK_N, BLOCK_K]
    x_rows = x_ptr + row * stride_x_row + cols[None, :]  # [1, BLOCK_K]
    acc, _ = gemv_product(x_rows, w_rows, norm_w_ptr, bias_ptr, features, 0, cols, tl.full([1], True, tl.int1),
                          feature_valid, num_in, eps, 1, BLOCK_N, BLOCK_K, K_TILES, NORM, False, BIAS, PDL, 1)
    logits_row = logits_ptr + row * num_experts
    logits = acc.to(x_ptr.dtype.element_ty).to(logits_ptr.dtype.element_ty)  # [1, BLOCK_N], rounded as activations
    tl.store(logits_row + features[None, :], logits, mask=feature_valid[None, :])
    # Every thread's logits are stored before the count moves (release); the program that
    # moves it last sees every program's (acquire) and routes.
    tl.debug_barrier()
    counter = counters_ptr + row
    counted = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
    if counted == tl.num_programs(0) - 1:
        weights, ids = top_k_routing(logits_row, num_experts, TOP_K, BLOCK_TOPK, BLOCK_E, RENORMALIZE)
        store_routing(weights, ids, out_weights_ptr + row * TOP_K, out_ids_ptr + row * TOP_K, TOP_K, BLOCK_TOPK)
        # every program of this token has counted, so nothing else touches the counter in this
        # launch, and the launch boundary orders the reset before the next launch's atomics
        tl.store(counter, 0)


_launcher = CachedLauncher(_router_route_kernel)


def router_route(
    hidden: torch.Tensor,  # [T, H]: the residual stream when norm_weight is given
    weight: torch.Tensor,  # [E, H] router weight
    top_k: int,
    renormalize: bool = True,
    norm_weight: torch.Tensor | None = None,  # [H] RMSNorm weight: the rows are normalised first
    eps: float = 1e-6,
    bias: torch.Tensor | None = None,  # [E]
    counters: torch.Tensor | None = None,  # int32 zeros, >= T of them; allocated when None
    impl: Impl = "auto",
    pdl: bool = False,
    tiles: tuple[int, int] | None = None,  # (BLOCK_N, num_warps); None: DEFAULT_TILES
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(logits [T, E] in hidden's dtype, weights [T, k] fp32, ids [T, k] int32): the router
    projection (`small_linear`'s rounding and fusions: norm, bias) and `route` of its logits,
    in one launch. `counters` are left zero (see `AttentionMetadata.split_counters`, whose
    scratch this shares: the counters are touched only after the PDL wait); `pdl` as for
    `route`."""
    num_experts, num_in = weight.shape
    block_topk, block_e = routing_blocks(num_experts, top_k)
    if weight.stride(-1) != 1:
        raise ValueError(f"router_route needs a router weight contiguous along H, got strides {tuple(weight.stride())}")
    if hidden.dim() != 2 or hidden.shape[1] != num_in:
        raise ValueError(f"router_route needs hidden [T, {num_in}] for a [{num_experts}, {num_in}] router weight, "
                         f"got {tuple(hidden.shape)}")
    if not use_triton(hidden, impl):
        logits = small_linear_reference(hidden, weight, norm_weight=norm_weight, eps=eps, bias=bias)
        return logits, *route_reference(logits, top_k, renormalize)
    num_tokens = hidden.shape[0]
    if counters is None:
        counters = torch.zeros(num_tokens, dtype=torch.int32, device=hidden.device)
    elif counters.dtype != torch.int32 or counters.numel() < num_tokens:
        raise ValueError(f"router_route needs >= {num_tokens} int32 counters, got {counters.numel()} {counters.dtype}")
    x = hidden if hidden.stride(-1) == 1 else hidden.contiguous()
    logits = torch.empty(num_tokens, num_experts, dtype=hidden.dtype, device=hidden.device)
    weights = torch.empty(num_tokens, top_k, dtype=torch.float32, device=hidden.device)
    ids = torch.empty(num_tokens, top_k, dtype=torch.int32, device=hidden.device)
    if not num_tokens:
        return logits, weights, ids
    block_k = min(triton.next_power_of_2(num_in), BLOCK_K_MAX)
    block_n, num_warps = tiles or DEFAULT_TILES
    pdl = pdl_enabled(x, pdl)
    _launcher(
        (triton.cdiv(num_experts, block_n), num_tokens),
        (x, weight, x if norm_weight is None else norm_weight, x if bias is None else bias, logits, weights, ids,
         counters, num_experts, num_in, x.stride(0), weight.stride(0), eps),
        (block_n, block_k, triton.cdiv(num_in, block_k), norm_weight is not None, bias is not None, top_k, block_topk,
         block_e, renormalize, pdl),
        num_warps,
        **launch_options(pdl),
    )
    return logits, weights, ids
