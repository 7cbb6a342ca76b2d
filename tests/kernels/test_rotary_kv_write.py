"""Fused rotary + KV write: Triton kernel vs apply_rotary + write_kv references."""

import pytest
import torch

from cleave.kernels.rotary_kv_write import rotary_write_kv, rotary_write_kv_reference
from tests.kernels.test_rotary import make_cache
from tests.kernels.ulp import NEAR_ZERO, assert_close_ulps

BLOCK_SIZE = 4


def run_both(tokens, num_q, num_kv, head_dim, rotary_dim, is_neox, dtype, slots, device="cpu", impl="triton"):
    generator = torch.Generator().manual_seed(tokens + head_dim)
    qkv = torch.randn(tokens, (num_q + 2 * num_kv) * head_dim, generator=generator, dtype=torch.float32)
    qkv = qkv.to(dtype).to(device)
    positions = torch.randint(0, 64, (tokens,), generator=generator).to(device)
    cos_sin = make_cache(64, rotary_dim).to(device)
    slot_mapping = torch.tensor(slots, dtype=torch.int64, device=device)
    results = []
    for fn in (lambda *a: rotary_write_kv(*a, impl=impl), rotary_write_kv_reference):
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
