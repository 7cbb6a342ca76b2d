"""Decode-batch GEMV kernel vs the unfused ops it replaces (norm, F.linear, SwiGLU, residual add),
single-split and split-K."""

import pytest
import torch

from cleave.kernels.small_linear import small_linear, small_linear_reference
from cleave.kernels.split_k import default_split_k
from tests.kernels.ulp import assert_close_ulps


def make(rows, num_out, num_in, gated, dtype=torch.float32, device="cpu", seed=0):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, num_in, generator=generator).to(dtype).to(device)
    weight = (torch.randn((2 if gated else 1) * num_out, num_in, generator=generator) * 0.1).to(dtype).to(device)
    norm_weight = (1 + 0.1 * torch.randn(num_in, generator=generator)).to(dtype).to(device)
    residual = torch.randn(rows, num_out, generator=generator).to(dtype).to(device)
    return x, weight, norm_weight, residual


@pytest.mark.parametrize(
    ("rows", "num_out", "num_in", "gated"), [(1, 40, 48, False), (5, 24, 70, True), (16, 16, 32, False), (40, 16, 24, True)]
)
def test_matches_reference_fp32(rows, num_out, num_in, gated):
    x, weight, _, _ = make(rows, num_out, num_in, gated)
    out = small_linear(x, weight, gated=gated, impl="triton", block_n=16, block_k=32)
    assert out.shape == (rows, num_out)
    torch.testing.assert_close(out, small_linear_reference(x, weight, gated), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norm_prologue_and_residual_epilogue(dtype):
    # qkv-style: normalise the residual stream, project; o-style: add the product in place.
    x, weight, norm_weight, residual = make(3, 24, 40, False, dtype)
    normed_out = small_linear(x, weight, norm_weight=norm_weight, eps=1e-5, impl="triton", block_n=16, block_k=16)
    expected = small_linear_reference(x, weight, norm_weight=norm_weight, eps=1e-5)
    atol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(normed_out.float(), expected.float(), rtol=1e-3 if dtype == torch.float32 else 2e-2, atol=atol)

    ours, theirs = residual.clone(), residual.clone()
    returned = small_linear(x, weight, add_to=ours, impl="triton", block_n=16, block_k=16)
    small_linear_reference(x, weight, add_to=theirs)
    assert returned is ours
    if dtype == torch.float32:
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    else:
        # the product may differ by an ulp before the add; the interpreter also truncates casts
        assert_close_ulps(ours, theirs, ulps=2, atol=2e-2)


def test_gated_with_norm_prologue():
    x, weight, norm_weight, _ = make(2, 16, 48, True)
    out = small_linear(x, weight, gated=True, norm_weight=norm_weight, impl="triton", block_n=16, block_k=16)
    expected = small_linear_reference(x, weight, gated=True, norm_weight=norm_weight)
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-5)


def test_rejects_bad_shapes_naming_the_limit():
    with pytest.raises(ValueError, match="at most 64 rows"):
        small_linear(torch.zeros(65, 8), torch.zeros(8, 8), impl="triton")
    with pytest.raises(ValueError, match="add_to must be"):
        small_linear(torch.zeros(2, 8), torch.zeros(4, 8), add_to=torch.zeros(2, 5), impl="triton")


# (gated, norm, add_to, reference tolerance) as in the single-split tests above
SPLIT_CASES = {"plain": (False, False, False, 1e-5), "gated_norm": (True, True, False, 1e-4), "add_to": (False, False, True, 1e-5)}


def _split_call(inputs, case, split_k, counters):
    x, weight, norm_weight, residual = inputs
    gated, norm, add, _ = SPLIT_CASES[case]
    return small_linear(
        x, weight, gated, norm_weight=norm_weight if norm else None, add_to=residual.clone() if add else None,
        impl="triton", block_n=16, block_k=16, split_k=split_k, counters=counters,
    )


@pytest.mark.parametrize("split_k", [2, 4])
@pytest.mark.parametrize("case", list(SPLIT_CASES))
def test_split_k_matches_reference_and_single_split(case, split_k):
    # K = 100: seven 16-wide steps, not a multiple of split_k * BLOCK_K; two feature tiles
    gated, norm, add, tolerance = SPLIT_CASES[case]
    inputs = make(3, 24, 100, gated, seed=1)
    x, weight, norm_weight, residual = inputs
    counters = torch.zeros(2, dtype=torch.int32)
    out = _split_call(inputs, case, split_k, counters)
    expected = small_linear_reference(
        x, weight, gated, norm_weight if norm else None, add_to=residual.clone() if add else None
    )
    torch.testing.assert_close(out, expected, rtol=tolerance, atol=1e-5)
    torch.testing.assert_close(out, _split_call(inputs, case, 1, None), rtol=1e-5, atol=1e-6)
    assert counters.tolist() == [0, 0]


def test_back_to_back_splits_share_one_counters_buffer():
    # qkv-style then o-style, as in a decode layer: the first launch leaves the counters zeroed
    x, weight, norm_weight, residual = make(2, 40, 96, False, seed=2)
    counters = torch.zeros(8, dtype=torch.int32)
    projected = small_linear(x, weight, norm_weight=norm_weight, impl="triton", block_n=16, block_k=16,
                             split_k=2, counters=counters)
    assert torch.count_nonzero(counters) == 0
    torch.testing.assert_close(projected, small_linear_reference(x, weight, norm_weight=norm_weight),
                               rtol=1e-4, atol=1e-5)
    ours, theirs = residual.clone(), residual.clone()
    small_linear(x, weight, add_to=ours, impl="triton", block_n=16, block_k=16, split_k=4, counters=counters)
    torch.testing.assert_close(ours, small_linear_reference(x, weight, add_to=theirs), rtol=1e-5, atol=1e-5)
    assert torch.count_nonzero(counters) == 0


def test_more_splits_than_steps_leaves_empty_slices_harmless():
    # K = 40: three 16-wide steps over eight splits, five of them empty
    x, weight, _, _ = make(1, 16, 40, False, seed=3)
    out = small_linear(x, weight, impl="triton", block_n=16, block_k=16, split_k=8)
    torch.testing.assert_close(out, small_linear_reference(x, weight), rtol=1e-5, atol=1e-5)


def test_default_split_k_fills_a_132_sm_gpu_without_short_splits():
    # Llama-3.2-1B at one row (tiles, K, BLOCK_K): qkv, o, gate_up, down
    assert default_split_k(96, 2048, 256) == 4
    assert default_split_k(128, 2048, 512) == 2  # four steps: two per split at most
    assert default_split_k(256, 2048, 256) == 2
    assert default_split_k(128, 8192, 512) == 4
    assert default_split_k(4008, 2048, 256) == 1  # lm_head: the grid is already large
    assert default_split_k(3, 48, 32) == 1  # fewer than two steps per split
    assert default_split_k(96, 2048, 256, num_sms=16) == 1


def test_rejects_a_counters_buffer_too_small_for_the_tiles():
    x, weight, _, _ = make(1, 48, 64, False)
    with pytest.raises(ValueError, match="at least 3 elements"):
        small_linear(x, weight, impl="triton", block_n=16, block_k=16, split_k=2,
                     counters=torch.zeros(2, dtype=torch.int32))


@pytest.mark.gpu
@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("rows", [1, 8, 64])
def test_gpu_bf16_llama_shapes(rows, gated):
    x, weight, norm_weight, residual = make(rows, 8192 if gated else 2048, 2048, gated, torch.bfloat16, "cuda")
    out = small_linear(x, weight, gated=gated, norm_weight=norm_weight)
    expected = small_linear_reference(x, weight, gated=gated, norm_weight=norm_weight)
    torch.testing.assert_close(out.float(), expected.float(), rtol=2e-2, atol=2e-2)
    if not gated:
        ours, theirs = residual.clone(), residual.clone()
        small_linear(x, weight, add_to=ours)
        small_linear_reference(x, weight, add_to=theirs)
        torch.testing.assert_close(ours.float(), theirs.float(), rtol=2e-2, atol=2e-2)


# name: (num_out, num_in, gated, norm, add_to) of the Llama-3.2-1B decode projections
LLAMA_PROJECTIONS = {
    "qkv": (3072, 2048, False, True, False),
    "o": (2048, 2048, False, False, True),
    "gate_up": (8192, 2048, True, True, False),
    "down": (2048, 8192, False, False, True),
}


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 8, 16])
@pytest.mark.parametrize("name", list(LLAMA_PROJECTIONS))
def test_gpu_split_k_llama_shapes_deterministic_and_graph_safe(name, rows):
    num_out, num_in, gated, norm, add = LLAMA_PROJECTIONS[name]
    x, weight, norm_weight, residual = make(rows, num_out, num_in, gated, torch.bfloat16, "cuda")
    norm_weight = norm_weight if norm else None
    counters = torch.zeros(4096, dtype=torch.int32, device="cuda")

    def call(split_k, target=None):
        if add and target is None:
            target = residual.clone()
        return small_linear(x, weight, gated, norm_weight=norm_weight, add_to=target, split_k=split_k, counters=counters)

    single, auto = call(1), call(None)
    expected = small_linear_reference(x, weight, gated, norm_weight, add_to=residual.clone() if add else None)
    torch.testing.assert_close(auto.float(), single.float(), rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(auto.float(), expected.float(), rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(call(None), auto, rtol=0, atol=0)  # fixed split order: bit-identical
    torch.cuda.synchronize()
    assert torch.count_nonzero(counters) == 0

    static = residual.clone() if add else None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graph_out = call(None, static)
    for _ in range(2):
        if add:
            static.copy_(residual)
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(graph_out, auto, rtol=0, atol=0)
        assert torch.count_nonzero(counters) == 0
