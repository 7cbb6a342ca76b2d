"""Fused rotary + KV write: Triton kernel vs apply_rotary + write_kv references."""

import pytest
import torch

from cleave.kernels.attention_decode import HeadNorms
from cleave.kernels.rms_norm import rms_norm
from cleave.kernels.rotary import apply_rotary
from cleave.kernels.rotary_kv_write import rotary_write_kv, rotary_write_kv_reference
from tests.kernels.test_rotary import make_cache
from tests.kernels.ulp import NEAR_ZERO, assert_close_ulps

BLOCK_SIZE = 4


def run_both(tokens, num_q, num_kv, head_dim, rotary_dim, is_neox, dtype, slots, device="cpu", impl="triton",
             head_norms=None):
    generator = torch.Generator().manual_seed(tokens + head_dim)
    qkv = torch.randn(tokens, (num_q + 2 * num_kv) * head_dim, generator=generator, dtype=torch.float32)
    qkv = qkv.to(dtype).to(device)
    positions = torch.randint(0, 64, (tokens,), generator=generator).to(device)
    cos_sin = make_cache(64, rotary_dim).to(device)
    slot_mapping = torch.tensor(slots, dtype=torch.int64, device=device)
    results = []
    for fn in (lambda *a: rotary_write_kv(*a, impl=impl, head_norms=head_norms),
               lambda *a: rotary_write_kv_reference(*a, head_norms=head_norms)):
        data = qkv.clone()
        q = data[:, : num_q * head_dim].view(tokens, num_q, head_dim)
        k = data[:, num_q * head_dim : (num_q + num_kv) * head_dim].view(tokens, num_kv, head_dim)
        v = data[:, (num_q + num_kv) * head_dim :].view(tokens, num_kv, head_dim)
        cache = torch.full((2, 6, BLOCK_SIZE, num_kv, head_dim), 7.0, dtype=dtype, device=device)
        fn(q, k, v, positions, cos_sin, cache, slot_mapping, is_neox)
        results.append((q.clone(), cache))
    return results


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize(("num_q", "num_kv", "head_dim", "rotary_dim"), [(4, 2, 16, 16), (3, 1, 24, 8)])
def test_fused_matches_rotary_then_write(num_q, num_kv, head_dim, rotary_dim, is_neox, dtype):
    # token 2 is padding: its q still rotates, nothing lands in the cache
    slots = [5, 22, -1, 0, 13]
    (q, cache), (q_ref, cache_ref) = run_both(5, num_q, num_kv, head_dim, rotary_dim, is_neox, dtype, slots)
    assert_close_ulps(q, q_ref, atol=NEAR_ZERO)
    assert_close_ulps(cache, cache_ref, atol=NEAR_ZERO)
    written = cache.view(2, -1, num_kv, head_dim)
    untouched = [s for s in range(written.shape[1]) if s not in slots]
    assert torch.all(written[:, untouched] == 7.0)
    # v and the unrotated tail of k are copies, bit for bit
    assert torch.equal(cache[1], cache_ref[1])
    assert torch.equal(cache[0][..., rotary_dim:], cache_ref[0][..., rotary_dim:])


@pytest.mark.gpu
@pytest.mark.parametrize("is_neox", [True, False])
def test_gpu_bf16_llama_shape(is_neox):
    slots = list(range(3, 3 + 2 * 9, 2))[:8] + [-1]
    (q, cache), (q_ref, cache_ref) = run_both(9, 32, 8, 64, 64, is_neox, torch.bfloat16, slots, device="cuda",
                                              impl="auto")
    assert_close_ulps(q, q_ref, atol=NEAR_ZERO)
    assert_close_ulps(cache, cache_ref, atol=NEAR_ZERO)


def _head_norms(head_dim: int, dtype: torch.dtype, device: str = "cpu") -> HeadNorms:
    generator = torch.Generator().manual_seed(head_dim)
    weights = (1.0 + 0.5 * torch.randn(2, head_dim, generator=generator)).to(dtype).to(device)
    return HeadNorms(weights[0], weights[1], 1e-6)


def _assert_close_normed(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """fp32: tight. bf16 in the interpreter: it truncates each fp32 -> bf16 rounding (normed,
    weighted, rotated) where torch rounds to nearest, a few ulps that the rotation's
    cancellation turns into absolute error near zero; the device is held to ulps on the GPU."""
    if actual.dtype == torch.float32:
        assert_close_ulps(actual, expected)
    else:
        torch.testing.assert_close(actual.float(), expected.float(), rtol=2**-6, atol=2**-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("is_neox", [True, False])
def test_head_norms_in_the_rotary_match_the_norm_kernels_then_the_rotary(is_neox, dtype):
    """Qwen3's per-head q/k RMSNorms inside the rotary + KV write launch: as the reference, and
    as the two RMSNorm launches over row copies of the heads before the plain rotary."""
    slots = [5, 22, -1, 0, 13]
    norms = _head_norms(16, dtype)
    (q, cache), (q_ref, cache_ref) = run_both(5, 4, 2, 16, 16, is_neox, dtype, slots, head_norms=norms)
    _assert_close_normed(q, q_ref)
    _assert_close_normed(cache, cache_ref)
    assert torch.equal(cache[1], cache_ref[1])
    (plain_q, _), _ = run_both(5, 4, 2, 16, 16, is_neox, dtype, slots)  # without the norms q differs
    assert not torch.allclose(plain_q.float(), q.float(), atol=0.1)
    # the unfused layout: the norms over row copies of the heads, then the rotary
    generator = torch.Generator().manual_seed(5 + 16)
    qkv = torch.randn(5, 8 * 16, generator=generator, dtype=torch.float32).to(dtype)
    positions = torch.randint(0, 64, (5,), generator=generator)
    q_rows = rms_norm(qkv[:, :64].reshape(-1, 16), norms.q_weight, norms.eps, impl="triton").view(5, 4, 16)
    k_rows = rms_norm(qkv[:, 64:96].reshape(-1, 16), norms.k_weight, norms.eps, impl="triton").view(5, 2, 16)
    apply_rotary(q_rows, k_rows, positions, make_cache(64, 16), is_neox, impl="triton")
    _assert_close_normed(q, q_rows)
    written = [slot for slot in slots if slot >= 0]
    _assert_close_normed(cache[0].view(-1, 2, 16)[written], k_rows[[i for i, s in enumerate(slots) if s >= 0]])


def test_head_norms_need_the_rotary_over_the_whole_head():
    with pytest.raises(ValueError, match="whole head"):
        run_both(2, 3, 1, 24, 8, True, torch.float32, [0, 1], head_norms=_head_norms(24, torch.float32))


@pytest.mark.gpu
def test_gpu_bf16_qwen3_heads_with_head_norms():
    slots = list(range(3, 3 + 2 * 9, 2))[:8] + [-1]
    norms = _head_norms(128, torch.bfloat16, "cuda")
    (q, cache), (q_ref, cache_ref) = run_both(9, 32, 4, 128, 128, True, torch.bfloat16, slots, device="cuda",
                                              impl="auto", head_norms=norms)
    assert_close_ulps(q, q_ref, atol=NEAR_ZERO)
    assert_close_ulps(cache, cache_ref, atol=NEAR_ZERO)
