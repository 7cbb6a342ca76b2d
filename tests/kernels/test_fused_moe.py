"""Fused MoE kernels (routing, alignment, grouped GEMMs) against their torch references, in
the interpreter with tiny shapes."""

from __future__ import annotations

import pytest
import torch

from cleave.kernels.fused_moe import align_block_size, fused_experts, fused_moe, route, sum_slots
from cleave.kernels.moe_gemv import MAX_TOKENS as GEMV_MAX_TOKENS
from cleave.kernels.moe_gemv import down_depth_for, moe_gemv
from cleave.kernels.moe_reference import (
    SILU,
    MoEActivation,
    align_block_size_reference,
    fused_experts_reference,
    fused_moe_reference,
    route_reference,
)
from cleave.kernels.rms_norm import rms_norm_reference
from tests.kernels.ulp import assert_close_ulps

HIDDEN, INTER, EXPERTS = 32, 64, 8


def _weights(dtype: torch.dtype, seed: int, bias: bool = False, experts: int = EXPERTS):
    generator = torch.Generator().manual_seed(seed)
    w13 = (torch.randn(experts, 2 * INTER, HIDDEN, generator=generator) * 0.2).to(dtype)
    w2 = (torch.randn(experts, HIDDEN, INTER, generator=generator) * 0.2).to(dtype)
    if not bias:
        return w13, w2, None, None
    w13_bias = (torch.randn(experts, 2 * INTER, generator=generator) * 0.5).to(dtype)
    w2_bias = (torch.randn(experts, HIDDEN, generator=generator) * 0.5).to(dtype)
    return w13, w2, w13_bias, w2_bias


def _ragged_logits(num_tokens: int, seed: int) -> torch.Tensor:
    """Router logits that send most entries to experts 0-2, a few elsewhere and none to 5."""
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(num_tokens, EXPERTS, generator=generator)
    logits[:, :3] += 2.0
    logits[:, 5] = -30.0
    return logits


def _assert_close(actual: torch.Tensor, expected: torch.Tensor, rounded_slots: int = 0) -> None:
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    if actual.dtype == torch.float32:
        torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)
    else:  # the activation, rounded to bf16 between the GEMMs, may differ by one ulp where the
        # first GEMM's sums straddle a rounding boundary: two ulps, or one of the largest output;
        # each of `rounded_slots` slot outputs stored in bf16 (truncated in the interpreter,
        # where the reference rounds to nearest) one more of the largest output
        scale = expected.float().abs().amax().item() * 2 ** -7
        assert_close_ulps(actual, expected, ulps=2, atol=scale * (1 + rounded_slots))


@pytest.mark.parametrize("num_tokens", [1, 3, 17, 72])  # 72: 18 entries per expert, 32-row blocks
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_moe_matches_reference(num_tokens, dtype):
    torch.manual_seed(num_tokens)
    hidden = torch.randn(num_tokens, HIDDEN).to(dtype)
    w13, w2, _, _ = _weights(dtype, seed=num_tokens)
    logits = _ragged_logits(num_tokens, seed=num_tokens).to(dtype)
    top_k = 2
    grouped = num_tokens > GEMV_MAX_TOKENS  # the grouped kernels round each slot's output
    expected = fused_moe_reference(hidden, w13, w2, logits, top_k, round_slots=grouped)
    actual = fused_moe(hidden, w13, w2, logits, top_k, impl="triton")
    _assert_close(actual, expected, rounded_slots=top_k if grouped else 0)
    assert expected.abs().amax() > 0.1  # the experts contribute


def test_a_prefill_sized_batch_matches_reference():
    """1024 tokens (~5 s in the interpreter; 4096 run on the GPU): 256 entries per expert on
    average, 64-row blocks, many blocks of one expert side by side, the alignment split over
    sixteen chunks."""
    hidden = torch.randn(1024, HIDDEN, generator=torch.Generator().manual_seed(11)) * 0.5
    w13, w2, _, _ = _weights(torch.float32, seed=11)
    logits = _ragged_logits(1024, seed=11)
    expected = fused_moe_reference(hidden, w13, w2, logits, 2)
    _assert_close(fused_moe(hidden, w13, w2, logits, 2, impl="triton"), expected)


@pytest.mark.parametrize("kernel", ["grouped", "gemv"])
@pytest.mark.parametrize("num_tokens", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_both_expert_kernels_match_reference_at_decode_sizes(num_tokens, dtype, kernel):
    """A token whose slots all pick one expert (ids given), and ragged routing: the per-entry
    GEMVs (the default up to `moe_gemv.MAX_TOKENS` tokens) and the grouped GEMMs alike."""
    generator = torch.Generator().manual_seed(11 + num_tokens)
    hidden = torch.randn(num_tokens, HIDDEN, generator=generator).to(dtype)
    w13, w2, _, _ = _weights(dtype, seed=12)
    weights, ids = route_reference(_ragged_logits(num_tokens, seed=num_tokens), 3, True)
    ids[0] = 6  # the first token's three slots on one expert
    expected = fused_experts_reference(hidden, w13, w2, weights, ids)
    actual = fused_experts(hidden, w13, w2, weights, ids, impl="triton", kernel=kernel)
    _assert_close(actual, expected)
    assert expected.abs().amax() > 0.1


@pytest.mark.parametrize("num_tokens", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemv_experts_normalise_their_input_and_add_into_the_residual(num_tokens, dtype):
    """The decode layout's MoE layer: residual += experts(rms_norm(residual)), the norm in
    the first kernel and the add in the second, rounded as the unfused ops round."""
    generator = torch.Generator().manual_seed(21 + num_tokens)
    residual = (torch.randn(num_tokens, HIDDEN, generator=generator) * 3).to(dtype)
    norm_weight = (torch.rand(HIDDEN, generator=generator) + 0.5).to(dtype)
    w13, w2, w13_bias, w2_bias = _weights(dtype, seed=22, bias=True)
    weights, ids = route_reference(_ragged_logits(num_tokens, seed=23), 2, True)
    normed = rms_norm_reference(residual, norm_weight, 1e-5)
    experts_out = fused_experts_reference(normed, w13, w2, weights, ids, SILU, w13_bias, w2_bias)
    expected = (residual.float() + experts_out.float()).to(dtype)
    actual = residual.clone()
    returned = moe_gemv(actual, w13, w2, weights, ids, SILU, w13_bias, w2_bias, norm_weight=norm_weight, eps=1e-5,
                        add_to=actual)
    assert returned is actual
    _assert_close(actual, expected)
    assert (experts_out.float().abs().amax() > 0.1) and not torch.equal(actual, residual)
    with pytest.raises(ValueError, match="add_to"):
        moe_gemv(residual, w13, w2, weights, ids, SILU, add_to=residual[:, :-1])


@pytest.mark.parametrize("down_tiles", [None, (8, 16, 4)])  # one K tile an entry; four (12 steps in the walk)
def test_down_weight_tiles_two_steps_ahead_sum_as_one_step_ahead(down_tiles):
    """The down kernel's tiles in flight (`down_depth`) change when weights are loaded, never
    the order of the sum: depth 2 equals depth 1 bit for bit, biases, ragged routing (a token
    with all three slots on one expert) and the residual add included, and both equal the
    reference. Any other depth is refused."""
    generator = torch.Generator().manual_seed(51)
    residual = (torch.randn(3, HIDDEN, generator=generator) * 2).to(torch.bfloat16)
    w13, w2, w13_bias, w2_bias = _weights(torch.bfloat16, seed=52, bias=True)
    weights, ids = route_reference(_ragged_logits(3, seed=53), 3, True)
    ids[1] = 4
    outputs = []
    for depth in (1, 2):
        stream = residual.clone()
        moe_gemv(stream, w13, w2, weights, ids, SILU, w13_bias, w2_bias, down_tiles=down_tiles, add_to=stream,
                 down_depth=depth)
        outputs.append(stream)
    assert torch.equal(outputs[0], outputs[1])
    experts_out = fused_experts_reference(residual, w13, w2, weights, ids, SILU, w13_bias, w2_bias)
    _assert_close(outputs[1], (residual.float() + experts_out.float()).to(torch.bfloat16))
    assert experts_out.float().abs().amax() > 0.1
    with pytest.raises(ValueError, match="down_depth"):
        moe_gemv(residual, w13, w2, weights, ids, SILU, down_depth=3)
    assert [down_depth_for(tokens) for tokens in (1, 2, 3, 4)] == [2, 2, 1, 1]  # the default: deep for few programs


@pytest.mark.parametrize("down_tiles", [None, (8, 16, 4)])  # one K tile an entry; four K tiles, four blocks
def test_down_walk_with_biases_a_shared_expert_and_the_residual_add(down_tiles):
    """The down kernel's walk over a token's entries, with biases, a token whose slots share
    one expert and the residual add: as the reference, and the same whether the routing was
    given or routed in the first kernel."""
    generator = torch.Generator().manual_seed(61)
    residual = (torch.randn(3, HIDDEN, generator=generator) * 2).to(torch.bfloat16)
    w13, w2, w13_bias, w2_bias = _weights(torch.bfloat16, seed=62, bias=True)
    logits = _ragged_logits(3, seed=63).to(torch.bfloat16)
    weights, ids = route_reference(logits, 3, True)
    given, routed = residual.clone(), residual.clone()
    moe_gemv(given, w13, w2, weights, ids, SILU, w13_bias, w2_bias, down_tiles=down_tiles, add_to=given)
    moe_gemv(routed, w13, w2, None, None, SILU, w13_bias, w2_bias, down_tiles=down_tiles, add_to=routed,
             router_logits=logits, top_k=3)
    assert torch.equal(given, routed)
    shared = residual.clone()
    ids[1] = 4
    moe_gemv(shared, w13, w2, weights, ids, SILU, w13_bias, w2_bias, down_tiles=down_tiles, add_to=shared)
    experts_out = fused_experts_reference(residual, w13, w2, weights, ids, SILU, w13_bias, w2_bias)
    _assert_close(shared, (residual.float() + experts_out.float()).to(torch.bfloat16))


# (tokens, experts, top_k, renormalize, gpt-oss experts (biases, clamped SwiGLU), norm prologue + add epilogue, dtype)
GEMV_ROUTING_CASES = [
    (1, 8, 2, True, False, False, torch.float32),
    (2, 6, 3, False, True, False, torch.bfloat16),
    (3, 6, 4, True, False, True, torch.float32),
    (4, 7, 2, False, True, True, torch.bfloat16),
]
FOUR_FEATURE_BLOCKS = (16, 32, 4)  # gate_up tiles: 16 of the 64 intermediate features per program


def _routed_layer(residual, w13, w2, logits, top_k, renormalize, activation, w13_bias, w2_bias, norm_weight):
    """The per-entry GEMVs given the router logits (4 gate_up programs an entry, each routing
    its token): (the layer's output, the routing it wrote). With `norm_weight` the layer is
    residual += experts(rms_norm(residual)), on a copy of `residual`."""
    num_tokens = residual.shape[0]
    routing = (torch.full((num_tokens, top_k), -1.0), torch.full((num_tokens, top_k), -1, dtype=torch.int32))
    fused = {} if norm_weight is None else {"norm_weight": norm_weight, "eps": 1e-5}
    stream = residual.clone()
    out = moe_gemv(stream, w13, w2, None, None, activation, w13_bias, w2_bias, FOUR_FEATURE_BLOCKS,
                   router_logits=logits, top_k=top_k, renormalize=renormalize, routing_out=routing,
                   add_to=stream if norm_weight is not None else None, **fused)
    return out, routing


def _reference_layer(residual, w13, w2, logits, top_k, renormalize, activation, w13_bias, w2_bias, norm_weight):
    """route_reference + fused_experts_reference (after rms_norm and before the residual add
    when `norm_weight` is given), in the ops' own rounding."""
    weights, ids = route_reference(logits, top_k, renormalize)
    if norm_weight is None:
        return fused_experts_reference(residual, w13, w2, weights, ids, activation, w13_bias, w2_bias)
    normed = rms_norm_reference(residual, norm_weight, 1e-5)
    experts_out = fused_experts_reference(normed, w13, w2, weights, ids, activation, w13_bias, w2_bias)
    return (residual.float() + experts_out.float()).to(residual.dtype)


@pytest.mark.parametrize(("num_tokens", "experts", "top_k", "renormalize", "gpt_oss", "norm_and_add", "dtype"),
                         GEMV_ROUTING_CASES)
def test_gemv_experts_route_inside_their_first_kernel(num_tokens, experts, top_k, renormalize, gpt_oss,
                                                      norm_and_add, dtype):
    """Router logits instead of the routing (the decode layout's MoE layer, one launch fewer):
    the routing the first kernel writes equals `route`'s bit for bit and the reference's ids;
    the layer equals the reference layer, and the same GEMVs given `route`'s routing exactly.
    Four programs an entry, so each of them must take the same slot's expert."""
    generator = torch.Generator().manual_seed(31 + num_tokens)
    residual = (torch.randn(num_tokens, HIDDEN, generator=generator) * 3).to(dtype)
    logits = (torch.randn(num_tokens, experts, generator=generator) * 2).to(dtype)
    norm_weight = (torch.rand(HIDDEN, generator=generator) + 0.5).to(dtype) if norm_and_add else None
    w13, w2, w13_bias, w2_bias = _weights(dtype, seed=32 + num_tokens, bias=gpt_oss, experts=experts)
    activation = MoEActivation("swiglu_clamped", alpha=1.702, limit=1.5) if gpt_oss else SILU
    layer = (residual, w13, w2, logits, top_k, renormalize, activation, w13_bias, w2_bias, norm_weight)
    out, (written_weights, written_ids) = _routed_layer(*layer)
    weights, ids = route(logits, top_k, renormalize, impl="triton")
    assert torch.equal(written_ids, ids) and torch.equal(written_weights, weights)
    reference_weights, reference_ids = route_reference(logits, top_k, renormalize)
    assert torch.equal(ids, reference_ids)
    torch.testing.assert_close(weights, reference_weights, rtol=1e-6, atol=1e-7)
    given = residual.clone()
    fused = {} if norm_weight is None else {"norm_weight": norm_weight, "eps": 1e-5, "add_to": given}
    given = moe_gemv(given, w13, w2, weights, ids, activation, w13_bias, w2_bias, FOUR_FEATURE_BLOCKS, **fused)
    assert torch.equal(out, given)
    expected = _reference_layer(*layer)
    if dtype == torch.bfloat16 and norm_and_add:  # the interpreter rounds fp32 to bf16 toward zero (torch: to
        # nearest), so the norm prologue's two roundings of each input element err one way: a few ulps of the sum
        assert_close_ulps(out, expected, ulps=2, atol=expected.float().abs().amax().item() * 2 ** -6)
    else:
        _assert_close(out, expected)
    assert (expected.float() - (residual.float() if norm_and_add else 0.0)).abs().amax() > 0.1


@pytest.mark.parametrize("renormalize", [True, False])
def test_gemv_routing_breaks_ties_as_route_does(renormalize):
    """Tied probabilities (at the top, across the k boundary, a whole row) over 7 experts:
    the lower expert id first, as `route` and the reference."""
    logits = torch.tensor(
        [
            [1.0, 3.0, 3.0, 0.0, 3.0, -1.0, 2.0],  # three-way tie at the top: 1, 2, 4
            [0.0] * 7,  # all equal: 0, 1, 2
            [2.0, 5.0, 2.0, 2.0, 5.0, 0.0, 2.0],  # the third slot from a four-way tie: 0
        ]
    )
    residual = torch.randn(3, HIDDEN, generator=torch.Generator().manual_seed(41))
    w13, w2, _, _ = _weights(torch.float32, seed=42, experts=7)
    layer = (residual, w13, w2, logits, 3, renormalize, SILU, None, None, None)
    out, (written_weights, written_ids) = _routed_layer(*layer)
    weights, ids = route(logits, 3, renormalize, impl="triton")
    assert written_ids.tolist() == [[1, 2, 4], [0, 1, 2], [1, 4, 0]] == ids.tolist()
    assert torch.equal(written_ids, route_reference(logits, 3, renormalize)[1])
    assert torch.equal(written_weights, weights)
    _assert_close(out, _reference_layer(*layer))


def test_gemv_experts_take_either_the_routing_or_the_router_logits():
    w13, w2, _, _ = _weights(torch.float32, seed=43)
    hidden, logits = torch.zeros(2, HIDDEN), torch.zeros(2, EXPERTS)
    weights, ids = route_reference(logits, 2, True)
    for routing, options in [
        ((None, None), {}),  # neither
        ((weights, ids), {"router_logits": logits, "top_k": 2}),  # both
        ((None, None), {"router_logits": logits}),  # no top_k
        ((weights, ids), {"routing_out": (weights.clone(), ids.clone())}),  # nothing to write there
    ]:
        with pytest.raises(ValueError, match="topk_weights and topk_ids, or router_logits and top_k"):
            moe_gemv(hidden, w13, w2, *routing, SILU, **options)
    with pytest.raises(ValueError, match=r"router_logits must be \[2, 8\]"):
        moe_gemv(hidden, w13, w2, None, None, SILU, router_logits=logits[:, :-1], top_k=2)
    with pytest.raises(ValueError, match="top_k must be in 1..8"):
        moe_gemv(hidden, w13, w2, None, None, SILU, router_logits=logits, top_k=9)
    with pytest.raises(ValueError, match="routing_out"):
        moe_gemv(hidden, w13, w2, None, None, SILU, router_logits=logits, top_k=2,
                 routing_out=(weights, ids.long()))


@pytest.mark.parametrize(("num_tokens", "top_k", "hidden_size"), [(3, 2, 40), (2, 8, 1100), (0, 4, 16)])
@pytest.mark.parametrize(("slot_dtype", "dtype"), [(torch.float32, torch.float32), (torch.float32, torch.bfloat16),
                                                   (torch.bfloat16, torch.bfloat16)])
def test_slot_sums_round_once_to_the_output_dtype(num_tokens, top_k, hidden_size, slot_dtype, dtype):
    # 40 columns: a masked tail in one block; 1100: two blocks, the second mostly masked;
    # bf16 slots (what the grouped path writes for bf16 models) are summed in fp32 as well
    generator = torch.Generator().manual_seed(hidden_size)
    per_slot = torch.randn(num_tokens * top_k, hidden_size, generator=generator).to(slot_dtype)
    out = torch.full((num_tokens, hidden_size), float("nan"), dtype=dtype)
    assert sum_slots(per_slot, top_k, out) is out
    expected = per_slot.view(num_tokens, top_k, hidden_size).double().sum(dim=1)  # exact for <= 8 slots
    # fp32 sums in another order: a few fp32 ulps; bf16: the one rounding (the interpreter
    # truncates where torch rounds to nearest: one ulp of slack)
    tolerance = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2 ** -7, "atol": 2 ** -7}
    torch.testing.assert_close(out.double(), expected.to(dtype).double(), **tolerance)


def test_slot_sums_refuse_mismatched_shapes():
    with pytest.raises(ValueError, match=r"per_slot \[6, 8\]"):
        sum_slots(torch.zeros(6, 9), 2, torch.empty(3, 8))


def test_fused_experts_refuses_an_unknown_kernel():
    w13, w2, _, _ = _weights(torch.float32, seed=1)
    with pytest.raises(ValueError, match="kernel"):
        fused_experts(torch.zeros(1, HIDDEN), w13, w2, torch.ones(1, 1), torch.zeros(1, 1, dtype=torch.int32),
                      kernel="dense")


@pytest.mark.parametrize("kernel", ["grouped", "gemv"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_clamped_swiglu_with_biases_matches_reference(dtype, kernel):
    """gpt-oss's experts: biases in both GEMMs and the clamped activation (its limit reached)."""
    hidden = (torch.randn(17, HIDDEN, generator=torch.Generator().manual_seed(3)) * 4).to(dtype)
    w13, w2, w13_bias, w2_bias = _weights(dtype, seed=4, bias=True)
    logits = _ragged_logits(17, seed=5).to(dtype)
    activation = MoEActivation("swiglu_clamped", alpha=1.702, limit=1.5)
    gate_up = hidden.float() @ w13[0].float().t()
    assert (gate_up.abs() > activation.limit).any()  # the clamp matters
    expected = fused_moe_reference(hidden, w13, w2, logits, 4, True, activation, w13_bias, w2_bias)
    weights, ids = route_reference(logits, 4, True)
    actual = fused_experts(hidden, w13, w2, weights, ids, activation, w13_bias, w2_bias, impl="triton", kernel=kernel)
    _assert_close(actual, expected)
    unclamped = fused_moe_reference(hidden, w13, w2, logits, 4, True, MoEActivation("swiglu_clamped", limit=1e9),
                                    w13_bias, w2_bias)
    assert (unclamped.float() - expected.float()).abs().amax() > 0.1


def test_route_ties_pick_lower_expert_and_renormalise():
    logits = torch.tensor(
        [
            [1.0, 3.0, 3.0, 0.0, 3.0, -1.0, 2.0, 0.5],  # three-way tie at the top
            [0.0] * EXPERTS,  # all equal
            [5.0, -2.0, 1.0, 1.0, 0.0, 4.0, 0.0, -3.0],
        ]
    )
    for renormalize in (True, False):
        weights, ids = route(logits, 2, renormalize, impl="triton")
        expected_weights, expected_ids = route_reference(logits, 2, renormalize)
        assert ids.tolist() == [[1, 2], [0, 1], [0, 5]] == expected_ids.tolist()
        torch.testing.assert_close(weights, expected_weights, rtol=1e-6, atol=1e-7)
    weights, _ = route(logits, 2, True, impl="triton")
    torch.testing.assert_close(weights.sum(dim=-1), torch.ones(3))
    # renormalised softmax of the top-k == softmax over the top-k logits (gpt-oss's router)
    torch.testing.assert_close(weights[2], torch.softmax(torch.tensor([5.0, 4.0]), dim=0))


@pytest.mark.parametrize(("num_tokens", "top_k", "block_size"),
                         [(1, 2, 16), (3, 4, 16), (17, 2, 16), (40, 3, 32), (100, 3, 16)])
def test_align_groups_entries_by_expert_in_fixed_size_outputs(num_tokens, top_k, block_size):
    """Up to 128 entries are one chunk; 300 are three, counted and scattered side by side."""
    _, ids = route_reference(_ragged_logits(num_tokens, seed=num_tokens), top_k, True)
    aligned = align_block_size(ids, EXPERTS, block_size)
    sorted_ids, expert_ids, padded = align_block_size_reference(ids, EXPERTS, block_size)
    max_blocks = -(-(num_tokens * top_k + EXPERTS * (block_size - 1)) // block_size)
    assert aligned.sorted_ids.shape == (max_blocks * block_size,)  # from T, k, E and the block only
    assert aligned.expert_ids.shape == (max_blocks,)
    assert int(aligned.num_padded) == padded
    assert torch.equal(aligned.sorted_ids[:padded], sorted_ids)
    assert (aligned.sorted_ids[padded:] == num_tokens * top_k).all()
    assert torch.equal(aligned.expert_ids[: padded // block_size], expert_ids)
    assert (aligned.expert_ids[padded // block_size :] == -1).all()
    assert 5 not in expert_ids.tolist()  # an expert without entries gets no block


def test_fused_experts_with_given_routing_and_a_lone_expert():
    """Every token on one expert (the others idle), given ids and weights directly."""
    hidden = torch.randn(3, HIDDEN, generator=torch.Generator().manual_seed(9))
    w13, w2, _, _ = _weights(torch.float32, seed=9)
    ids = torch.tensor([[6], [6], [6]], dtype=torch.int32)
    weights = torch.tensor([[1.0], [0.5], [0.25]])
    actual = fused_experts(hidden, w13, w2, weights, ids, impl="triton")
    gate, up = (hidden @ w13[6].t()).chunk(2, dim=-1)
    expected = (torch.nn.functional.silu(gate) * up) @ w2[6].t() * weights
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1, 64, 512, 4096])
def test_qwen3_30b_shapes_match_reference_on_gpu(num_tokens):
    """Qwen3-30B-A3B's MoE block (128 experts of 768, top-8, hidden 2048) in bf16."""
    generator = torch.Generator(device="cuda").manual_seed(num_tokens)
    w13 = torch.randn(128, 1536, 2048, device="cuda", generator=generator).mul_(2048**-0.5).bfloat16()
    w2 = torch.randn(128, 2048, 768, device="cuda", generator=generator).mul_(768**-0.5).bfloat16()
    hidden = torch.randn(num_tokens, 2048, device="cuda", generator=generator).bfloat16()
    logits = torch.randn(num_tokens, 128, device="cuda", generator=generator).bfloat16()
    expected = fused_moe_reference(hidden, w13, w2, logits, 8)
    actual = fused_moe(hidden, w13, w2, logits, 8)  # auto: Triton on CUDA
    # the GPU's bf16 tensor-core products accumulate in another order than the reference
    torch.testing.assert_close(actual.float(), expected.float(), rtol=2 ** -6, atol=2 ** -6)


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [2, 17])  # 2: the per-entry GEMVs; 17: the grouped GEMMs
def test_fused_moe_replays_in_a_cuda_graph_with_new_routing(num_tokens):
    """No host sync: captured once, replayed with other tokens and router logits."""
    generator = torch.Generator(device="cuda").manual_seed(0)
    w13 = torch.randn(EXPERTS, 2 * INTER, HIDDEN, device="cuda", generator=generator) * 0.2
    w2 = torch.randn(EXPERTS, HIDDEN, INTER, device="cuda", generator=generator) * 0.2
    hidden = torch.randn(num_tokens, HIDDEN, device="cuda", generator=generator)
    logits = torch.randn(num_tokens, EXPERTS, device="cuda", generator=generator)
    fused_moe(hidden, w13, w2, logits, 2)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_moe(hidden, w13, w2, logits, 2)
    for seed in (1, 2):
        hidden.copy_(torch.randn(num_tokens, HIDDEN, device="cuda", generator=generator.manual_seed(seed)))
        logits.copy_(_ragged_logits(num_tokens, seed).cuda())
        graph.replay()
        torch.testing.assert_close(out, fused_moe_reference(hidden, w13, w2, logits, 2), rtol=1e-4, atol=1e-4)
