"""Rotary embedding: Triton kernel vs torch reference, in place on strided q/k views."""

import pytest
import torch

from cleave.kernels.rotary import apply_rotary, apply_rotary_reference
from tests.kernels.ulp import NEAR_ZERO, assert_close_ulps


def make_cache(max_position: int, rotary_dim: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rotary_dim, 2).float() / rotary_dim))
    freqs = torch.outer(torch.arange(max_position).float(), inv_freq)  # [P, R/2]
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1).to(dtype)  # [P, R]


def split_qkv(qkv: torch.Tensor, num_q: int, num_kv: int, head_dim: int):
    # qkv: [T, (Hq + 2 Hkv) D] -> strided views q [T, Hq, D], k [T, Hkv, D]
    tokens = qkv.shape[0]
    q = qkv[:, : num_q * head_dim].view(tokens, num_q, head_dim)
    k = qkv[:, num_q * head_dim : (num_q + num_kv) * head_dim].view(tokens, num_kv, head_dim)
    return q, k


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("tokens,num_q,num_kv,head_dim,rotary_dim", [(13, 4, 2, 16, 16), (3, 5, 1, 24, 8)])
def test_rotary_matches_reference(tokens, num_q, num_kv, head_dim, rotary_dim, is_neox, dtype):
    torch.manual_seed(0)
    qkv = torch.randn(tokens, (num_q + 2 * num_kv) * head_dim, dtype=dtype)
    expected, original = qkv.clone(), qkv.clone()
    positions = torch.randint(1, 100, (tokens,))
    cache = make_cache(100, rotary_dim)
    apply_rotary(*split_qkv(qkv, num_q, num_kv, head_dim), positions, cache, is_neox, impl="triton")
    apply_rotary_reference(*split_qkv(expected, num_q, num_kv, head_dim), positions, cache, is_neox)
    assert_close_ulps(qkv, expected, atol=NEAR_ZERO)
    # the pass-through part of each head and the v slice are bit-identical
    q, k = split_qkv(qkv, num_q, num_kv, head_dim)
    q0, k0 = split_qkv(expected, num_q, num_kv, head_dim)
    assert torch.equal(q[..., rotary_dim:], q0[..., rotary_dim:])
    assert torch.equal(k[..., rotary_dim:], k0[..., rotary_dim:])
    v_start = (num_q + num_kv) * head_dim
    assert torch.equal(qkv[:, v_start:], expected[:, v_start:])
    assert not torch.equal(q[..., :rotary_dim], split_qkv(original, num_q, num_kv, head_dim)[0][..., :rotary_dim])


def test_layouts_differ_and_position_zero_is_identity():
    torch.manual_seed(1)
    query, key = torch.randn(2, 2, 8), torch.randn(2, 1, 8)
    cache = make_cache(10, 8)
    neox_q, gptj_q = query.clone(), query.clone()
    apply_rotary(neox_q, key.clone(), torch.tensor([0, 3]), cache, True, impl="triton")
    apply_rotary(gptj_q, key.clone(), torch.tensor([0, 3]), cache, False, impl="triton")
    assert torch.equal(neox_q[0], query[0]) and torch.equal(gptj_q[0], query[0])
    assert not torch.allclose(neox_q[1], gptj_q[1])


def test_int32_positions_and_bf16_cache():
    torch.manual_seed(2)
    query, key = torch.randn(4, 3, 32, dtype=torch.bfloat16), torch.randn(4, 1, 32, dtype=torch.bfloat16)
    expected_q, expected_k = query.clone(), key.clone()
    positions = torch.tensor([5, 0, 17, 2], dtype=torch.int32)
    cache = make_cache(20, 32, torch.bfloat16)
    apply_rotary(query, key, positions, cache, True, impl="triton")
    apply_rotary_reference(expected_q, expected_k, positions, cache, True)
    assert_close_ulps(query, expected_q, atol=NEAR_ZERO)
    assert_close_ulps(key, expected_k, atol=NEAR_ZERO)


@pytest.mark.gpu
@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("tokens,num_q,num_kv,head_dim,rotary_dim", [(1, 32, 8, 128, 128), (4096, 32, 8, 128, 64)])
def test_gpu_bf16(tokens, num_q, num_kv, head_dim, rotary_dim, is_neox):
    # the second round takes the cached launch path, on fresh data
    for seed in range(2):
        torch.manual_seed(seed)
        qkv = torch.randn(tokens, (num_q + 2 * num_kv) * head_dim, dtype=torch.bfloat16, device="cuda")
        expected = qkv.clone()
        positions = torch.randint(0, 32768, (tokens,), device="cuda")
        cache = make_cache(32768, rotary_dim).cuda()
        apply_rotary(*split_qkv(qkv, num_q, num_kv, head_dim), positions, cache, is_neox)
        apply_rotary_reference(*split_qkv(expected, num_q, num_kv, head_dim), positions, cache, is_neox)
        assert_close_ulps(qkv, expected, atol=NEAR_ZERO)
