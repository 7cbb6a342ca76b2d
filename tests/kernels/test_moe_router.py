"""The router GEMV whose last program routes (`moe_router.router_route`): its logits against
the unfused projection's torch reference, its routing against `route` of those logits, and its
counters, in the interpreter with tiny shapes and on the GPU at the real models' shapes."""

from __future__ import annotations

import pytest
import torch

from cleave.kernels.fused_moe import route, route_num_warps
from cleave.kernels.moe_router import router_route
from cleave.kernels.small_linear import small_linear, small_linear_reference
from tests.kernels.ulp import assert_close_ulps


def _inputs(tokens: int, experts: int, hidden: int, dtype: torch.dtype, seed: int, device: str = "cpu"):
    generator = torch.Generator(device=device).manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator, device=device)

    x = (randn(tokens, hidden) * 3).to(dtype)  # the residual stream: not unit scale
    weight = (randn(experts, hidden) * hidden**-0.5).to(dtype)
    norm_weight = (1 + 0.2 * randn(hidden)).to(dtype)
    bias = (0.5 * randn(experts)).to(dtype)
    return x, weight, norm_weight, bias


def _assert_logits(logits, x, weight, norm_weight, bias):  # noqa: ANN001, ANN202
    expected = small_linear_reference(x, weight, norm_weight=norm_weight, eps=1e-5, bias=bias)
    if logits.dtype == torch.float32:
        torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-5)
    else:  # the normalised input is rounded before the product; the interpreter truncates its casts
        assert_close_ulps(logits, expected, ulps=2, atol=2e-2)


def _check(x, weight, top_k, renormalize, norm_weight, bias, counters, **options):  # noqa: ANN001, ANN202
    logits, weights, ids = router_route(x, weight, top_k, renormalize, norm_weight, 1e-5, bias, counters=counters,
                                        impl="triton", **options)
    _assert_logits(logits, x, weight, norm_weight, bias)
    if not x.is_cuda:  # the interpreter sums alike at any warp count: the register GEMV's, bit for bit
        assert torch.equal(logits, small_linear(x, weight, norm_weight=norm_weight, eps=1e-5, bias=bias, kernel="fma",
                                                impl="triton"))
    _assert_routes_like_route(logits, weights, ids, top_k, renormalize, options.get("tiles"))
    assert not counters.any()  # left zero for the next launch


def _assert_routes_like_route(logits, weights, ids, top_k, renormalize, tiles):  # noqa: ANN001, ANN202
    """The routing is `route`'s of the logits the kernel wrote (one helper routes both): bit
    for bit on `route`'s warp count; on more warps (`tiles`) the softmax's and the top-k's sums
    associate in another order on the GPU, so the same experts, their weights within 1e-6."""
    expected_weights, expected_ids = route(logits, top_k, renormalize, impl="triton")
    assert torch.equal(ids, expected_ids)
    if logits.is_cuda and tiles is not None and tiles[1] != route_num_warps(logits.shape[-1]):
        torch.testing.assert_close(weights, expected_weights, rtol=1e-6, atol=0)
    else:
        assert torch.equal(weights, expected_weights)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("tokens", "experts", "hidden", "top_k", "renormalize", "norm", "bias"), [
    (1, 16, 64, 4, True, True, False),  # Qwen3-MoE's: the layer's norm inside, renormalised
    (2, 12, 96, 3, False, False, True),  # gpt-oss's bias; experts and top-k not powers of two; two tokens
    (1, 4, 2112, 2, True, True, True),  # hidden past one 2048-wide K tile
])
def test_router_route_matches_the_projection_and_route(dtype, tokens, experts, hidden, top_k, renormalize, norm,
                                                       bias):
    x, weight, norm_weight, bias_vector = _inputs(tokens, experts, hidden, dtype, seed=experts + hidden)
    counters = torch.zeros(3, dtype=torch.int32)
    _check(x, weight, top_k, renormalize, norm_weight if norm else None, bias_vector if bias else None, counters)


def test_router_route_with_several_rows_a_program_counts_each_program_once():
    # 12 experts in blocks of 4 (3 programs), over two warps: the last of 3 routes
    x, weight, norm_weight, bias = _inputs(2, 12, 64, torch.float32, seed=4)
    _check(x, weight, 3, True, norm_weight, bias, torch.zeros(2, dtype=torch.int32), tiles=(4, 2))


def test_router_route_reuses_its_counters_launch_after_launch():
    counters = torch.zeros(1, dtype=torch.int32)
    for seed in (1, 2):
        x, weight, norm_weight, _ = _inputs(1, 8, 32, torch.float32, seed=seed)
        _check(x, weight, 2, True, norm_weight, None, counters)


def test_router_route_refusals_name_the_argument():
    x, weight, _, _ = _inputs(2, 8, 32, torch.float32, seed=0)
    with pytest.raises(ValueError, match="top_k must be in 1..8"):
        router_route(x, weight, 9, impl="triton")
    with pytest.raises(ValueError, match=r"hidden \[T, 32\]"):
        router_route(x[:, :16], weight, 2, impl="triton")
    with pytest.raises(ValueError, match=">= 2 int32 counters"):
        router_route(x, weight, 2, counters=torch.zeros(1, dtype=torch.int32), impl="triton")
    with pytest.raises(ValueError, match="contiguous along H"):
        router_route(x, weight.t().contiguous().t(), 2, impl="triton")


def test_router_route_torch_path_is_the_reference():
    x, weight, norm_weight, bias = _inputs(2, 8, 32, torch.float32, seed=3)
    logits, weights, ids = router_route(x, weight, 3, False, norm_weight, 1e-5, bias, impl="torch")
    assert torch.equal(logits, small_linear_reference(x, weight, norm_weight=norm_weight, eps=1e-5, bias=bias))
    expected_weights, expected_ids = route(logits, 3, False, impl="torch")
    assert torch.equal(ids, expected_ids) and torch.equal(weights, expected_weights)


@pytest.mark.gpu
@pytest.mark.parametrize(("experts", "hidden", "top_k", "bias", "tiles"), [
    (128, 2048, 8, False, None),  # Qwen3-30B-A3B
    (128, 2048, 8, False, (4, 4)),  # four rows a program over four warps: the routing crosses warps
    (32, 2880, 4, True, None),  # gpt-oss-20b: two K tiles, a bias
])
def test_gpu_router_route_matches_the_projection_and_route(experts, hidden, top_k, bias, tiles):
    """At the real models' shapes, with PDL, replayed from a CUDA graph (the counters must be
    zero again at every replay)."""
    x, weight, norm_weight, bias_vector = _inputs(1, experts, hidden, torch.bfloat16, seed=experts, device="cuda")
    bias_vector = bias_vector if bias else None
    counters = torch.zeros(4, dtype=torch.int32, device="cuda")
    _check(x, weight, top_k, True, norm_weight, bias_vector, counters, pdl=True, tiles=tiles)

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        logits, weights, ids = router_route(x, weight, top_k, True, norm_weight, 1e-5, bias_vector,
                                            counters=counters, pdl=True, tiles=tiles)
    for seed in (1, 2, 3):
        x.copy_(_inputs(1, experts, hidden, torch.bfloat16, seed=seed, device="cuda")[0])
        graph.replay()
        torch.cuda.synchronize()
        _assert_logits(logits, x, weight, norm_weight, bias_vector)
        _assert_routes_like_route(logits, weights, ids, top_k, True, tiles)
        assert not counters.any()
