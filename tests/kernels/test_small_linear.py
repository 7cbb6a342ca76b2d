"""Decode-batch GEMV kernel vs the unfused ops it replaces (norm, F.linear, SwiGLU, residual add)."""

import pytest
import torch

from cleave.kernels.gemv import MIN_PROGRAMS, RotaryKVWrite, gemv_tiles, tiles_ahead
from cleave.kernels.small_linear import small_linear, small_linear_reference
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


@pytest.mark.parametrize("kernel", ["dot", "fma"])
@pytest.mark.parametrize(("rows", "dtype"), [(1, torch.float32), (3, torch.float32), (1, torch.bfloat16), (4, torch.bfloat16)])
def test_kernels_agree_on_every_fusion(kernel, rows, dtype):
    # both kernels behind small_linear: two K tiles with a ragged tail, a ragged last feature block
    x, weight, norm_weight, residual = make(rows, 20, 40, True, dtype)
    out = small_linear(x, weight, gated=True, norm_weight=norm_weight, impl="triton", kernel=kernel, block_n=8, block_k=32)
    expected = small_linear_reference(x, weight, gated=True, norm_weight=norm_weight)
    if dtype == torch.float32:
        torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-5)
    else:
        assert_close_ulps(out, expected, ulps=2, atol=2e-2)
    plain_weight = weight[:20]
    ours, theirs = residual.clone(), residual.clone()
    small_linear(x, plain_weight, add_to=ours, impl="triton", kernel=kernel, block_n=8, block_k=32)
    small_linear_reference(x, plain_weight, add_to=theirs)
    if dtype == torch.float32:
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    else:
        assert_close_ulps(ours, theirs, ulps=2, atol=2e-2)


def _rotary_case(rows, dtype, rotary_dim, is_neox, device="cpu"):
    generator = torch.Generator().manual_seed(3)
    num_q_heads, num_kv_heads, head_dim, block_size, num_blocks = 4, 2, 8, 4, 6
    x, weight, norm_weight, _ = make(rows, (num_q_heads + 2 * num_kv_heads) * head_dim, 24, False, dtype, device)
    cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=generator).to(dtype).to(device)
    cos_sin = torch.rand(32, rotary_dim, generator=generator).to(device)
    positions = torch.tensor([5, 17, 0, 30][:rows], device=device)
    slots = torch.tensor([9, -1, 22, 3][:rows], device=device)  # row 1 is padding: no cache write
    rotary = RotaryKVWrite(positions, cos_sin, cache, slots, num_q_heads, num_kv_heads, head_dim, is_neox)
    return x, weight, norm_weight, rotary


@pytest.mark.parametrize(("rows", "dtype", "rotary_dim", "is_neox"), [
    (1, torch.float32, 8, True), (2, torch.float32, 4, True), (1, torch.bfloat16, 8, True), (3, torch.float32, 8, False),
])
def test_rotary_kv_write_epilogue_matches_the_unfused_ops(rows, dtype, rotary_dim, is_neox):
    x, weight, norm_weight, rotary = _rotary_case(rows, dtype, rotary_dim, is_neox)
    expected_cache = rotary.kv_cache.clone()
    expected = small_linear(x, weight, norm_weight=norm_weight, impl="torch",
                            rotary=RotaryKVWrite(**{**vars(rotary), "kv_cache": expected_cache}))
    out = small_linear(x, weight, norm_weight=norm_weight, impl="triton", rotary=rotary, block_n=4)
    if dtype == torch.float32:
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(rotary.kv_cache, expected_cache, rtol=1e-5, atol=1e-5)
    else:
        assert_close_ulps(out, expected, ulps=2, atol=2e-2)
        assert_close_ulps(rotary.kv_cache, expected_cache, ulps=2, atol=2e-2)
    before = _rotary_case(rows, dtype, rotary_dim, is_neox)[3].kv_cache
    changed = (rotary.kv_cache != before).any(-1).any(-1).any(0).flatten()  # per slot
    assert {int(slot) for slot in changed.nonzero()} == {int(slot) for slot in rotary.slot_mapping if slot >= 0}


def test_rotary_epilogue_rejects_what_it_cannot_fuse():
    x, weight, norm_weight, rotary = _rotary_case(1, torch.float32, 8, True)
    with pytest.raises(ValueError, match="expected"):
        small_linear(x, weight[:-8], rotary=rotary, impl="triton")
    with pytest.raises(ValueError, match="epilogue"):
        small_linear(x, weight, rotary=rotary, impl="triton", kernel="dot")


def test_out_dtype_stores_the_rounded_product_widened():
    x, weight, _, _ = make(1, 20, 40, False, torch.bfloat16)
    out = small_linear(x, weight, impl="triton", out_dtype=torch.float32, block_k=32)
    assert out.dtype == torch.float32
    expected = small_linear_reference(x, weight).float()
    assert_close_ulps(out.to(torch.bfloat16), expected.to(torch.bfloat16), ulps=1, atol=1e-2)
    assert torch.equal(out, out.to(torch.bfloat16).float())  # bf16 values, widened
    with pytest.raises(ValueError, match="out_dtype"):
        small_linear(x, weight, impl="triton", out_dtype=torch.float32, kernel="dot")


def test_rejects_bad_shapes_naming_the_limit():
    with pytest.raises(ValueError, match="at most 64 rows"):
        small_linear(torch.zeros(65, 8), torch.zeros(8, 8), impl="triton")
    with pytest.raises(ValueError, match="add_to must be"):
        small_linear(torch.zeros(2, 8), torch.zeros(4, 8), add_to=torch.zeros(2, 5), impl="triton")
    with pytest.raises(ValueError, match="at most 4 rows"):
        small_linear(torch.zeros(5, 8), torch.zeros(8, 8), impl="triton", kernel="fma")


@pytest.mark.gpu
@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize(("rows", "kernel"), [(1, "fma"), (1, "dot"), (3, "fma"), (8, "auto"), (64, "dot")])
@pytest.mark.parametrize("num_in", [2048, 8192])
def test_gpu_bf16_llama_shapes(rows, kernel, gated, num_in):
    # the kernels that round as the unfused ops do (17-64 rows under "auto": test_splitk_linear)
    x, weight, norm_weight, residual = make(rows, 8192 if gated else 2048, num_in, gated, torch.bfloat16, "cuda")
    out = small_linear(x, weight, gated=gated, norm_weight=norm_weight, kernel=kernel)
    expected = small_linear_reference(x, weight, gated=gated, norm_weight=norm_weight)
    torch.testing.assert_close(out.float(), expected.float(), rtol=2e-2, atol=2e-2)
    if not gated:
        ours, theirs = residual.clone(), residual.clone()
        small_linear(x, weight, add_to=ours, kernel=kernel)
        small_linear_reference(x, weight, add_to=theirs)
        torch.testing.assert_close(ours.float(), theirs.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("kernel", ["dot", "fma"])
@pytest.mark.parametrize(("rows", "dtype"), [(1, torch.float32), (3, torch.float32), (1, torch.bfloat16)])
def test_bias_is_added_before_the_rounding_and_the_residual_add(kernel, rows, dtype):
    x, weight, norm_weight, residual = make(rows, 20, 40, False, dtype)
    bias = torch.randn(20, generator=torch.Generator().manual_seed(9)).to(dtype)
    out = small_linear(x, weight, norm_weight=norm_weight, bias=bias, impl="triton", kernel=kernel, block_n=8, block_k=32)
    expected = small_linear_reference(x, weight, norm_weight=norm_weight, bias=bias)
    ours, theirs = residual.clone(), residual.clone()
    small_linear(x, weight, bias=bias, add_to=ours, impl="triton", kernel=kernel, block_n=8, block_k=32)
    small_linear_reference(x, weight, bias=bias, add_to=theirs)
    if dtype == torch.float32:
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    else:
        assert_close_ulps(out, expected, ulps=2, atol=2e-2)
        assert_close_ulps(ours, theirs, ulps=2, atol=2e-2)
    assert not torch.allclose(out, small_linear_reference(x, weight, norm_weight=norm_weight), atol=1e-2)


def test_a_biased_qkv_projection_rotates_and_caches_the_biased_product():
    x, weight, norm_weight, rotary = _rotary_case(2, torch.float32, 8, True)
    bias = torch.randn(weight.shape[0], generator=torch.Generator().manual_seed(5))
    expected_cache = rotary.kv_cache.clone()
    expected = small_linear(x, weight, norm_weight=norm_weight, bias=bias, impl="torch",
                            rotary=RotaryKVWrite(**{**vars(rotary), "kv_cache": expected_cache}))
    out = small_linear(x, weight, norm_weight=norm_weight, bias=bias, impl="triton", rotary=rotary, block_n=4)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(rotary.kv_cache, expected_cache, rtol=1e-5, atol=1e-5)


def test_bias_refusals_name_the_argument():
    x, weight, _, _ = make(2, 16, 32, True)
    with pytest.raises(ValueError, match="bias must be"):
        small_linear(x, weight, gated=True, bias=torch.zeros(32), impl="triton")
    with pytest.raises(ValueError, match="bias must be"):
        small_linear(x, weight[:16], bias=torch.zeros(8), impl="triton")
    with pytest.raises(ValueError, match="split-K kernel adds no bias"):
        small_linear(x, weight[:16], bias=torch.zeros(16), impl="triton", kernel="splitk")
    rows = torch.randn(20, 32)  # 20 rows would take the split-K kernel; a bias sends them to the dot kernel
    bias = torch.randn(16)
    torch.testing.assert_close(small_linear(rows, weight[:16], bias=bias, impl="triton"),
                               small_linear_reference(rows, weight[:16], bias=bias), rtol=1e-4, atol=1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize(("rows", "kernel"), [(1, "fma"), (1, "dot"), (4, "auto"), (20, "auto")])
def test_gpu_bf16_biased_gpt_oss_shapes(rows, kernel):
    # gpt-oss-20b's qkv (64 q + 2 x 8 kv heads of 64 from 2880) and o (4096 -> 2880, added in place)
    x, weight, norm_weight, _ = make(rows, 5120, 2880, False, torch.bfloat16, "cuda")
    bias = torch.randn(5120, device="cuda").to(torch.bfloat16)
    out = small_linear(x, weight, norm_weight=norm_weight, bias=bias, kernel=kernel)
    expected = small_linear_reference(x, weight, norm_weight=norm_weight, bias=bias)
    torch.testing.assert_close(out.float(), expected.float(), rtol=2e-2, atol=2e-2)
    attn, o_weight, _, residual = make(rows, 2880, 4096, False, torch.bfloat16, "cuda", seed=1)
    o_bias = torch.randn(2880, device="cuda").to(torch.bfloat16)
    ours, theirs = residual.clone(), residual.clone()
    small_linear(attn, o_weight, bias=o_bias, add_to=ours, kernel=kernel)
    small_linear_reference(attn, o_weight, bias=o_bias, add_to=theirs)
    torch.testing.assert_close(ours.float(), theirs.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize(("num_in", "add"), [(60, True), (60, False), (100, True)])
def test_register_gemv_over_two_or_four_k_tiles(num_in, add):
    # 32-wide tiles, the last ragged: two tiles with add_to take both before the wait
    # (gemv.tiles_ahead -> 2), the others one tile ahead
    x, weight, norm_weight, residual = make(1, 24, num_in, False, torch.float32)
    ours, theirs = residual.clone(), residual.clone()
    out = small_linear(x, weight, norm_weight=norm_weight, add_to=ours if add else None, impl="triton", kernel="fma",
                       block_n=8, block_k=32)
    expected = small_linear_reference(x, weight, norm_weight=norm_weight, add_to=theirs if add else None)
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-5)


def test_two_tiles_ahead_only_for_a_whole_two_tile_slice_in_one_wave():
    assert tiles_ahead(add=True, k_tiles=2, programs=256, sms=132) == 2  # Qwen3-30B-A3B's o
    assert tiles_ahead(add=True, k_tiles=2, programs=360, sms=132) == 1  # gpt-oss-20b's o (measured slower)
    assert tiles_ahead(add=True, k_tiles=4, programs=256, sms=132) == 1  # Llama-3.2-1B's down
    assert tiles_ahead(add=False, k_tiles=2, programs=256, sms=132) == 1  # qkv, lm_head
    assert tiles_ahead(add=True, k_tiles=1, programs=256, sms=132) == 1


def test_narrow_projections_keep_a_wide_grid():
    assert gemv_tiles(1, 32, 2880, gated=False) == (1, 2048, 8)  # gpt-oss-20b's router: 32 programs, not 4
    assert gemv_tiles(1, 128, 2048, gated=False) == (4, 2048, 4)  # Qwen3-30B-A3B's router: 32 already
    assert gemv_tiles(1, 2048, 8192, gated=False) == (8, 2048, 8)  # Llama-3.2-1B's down: wide, unchanged
    assert gemv_tiles(1, 16, 64, gated=True) == (2, 64, 4)  # a gated pair stays whole
    for num_out in (8, 48, 100, 256):
        block_n = gemv_tiles(1, num_out, 4096, gated=False)[0]
        assert -(-num_out // block_n) >= min(MIN_PROGRAMS, num_out)
