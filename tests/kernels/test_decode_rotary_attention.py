"""Decode attention that also applies the rotary embedding and writes the new K/V, against
rotary_write_kv_reference followed by paged_attention_reference."""

from __future__ import annotations

import pytest
import torch

from cleave.kernels.attention import paged_attention_reference
from cleave.kernels.attention_decode import HeadNorms, NewKV, paged_decode_attention
from cleave.kernels.rms_norm import rms_norm_reference
from cleave.kernels.row_norm import DeferredRMSNorm, inverse_rms_reference
from cleave.kernels.rotary_kv_write import rotary_write_kv_reference
from cleave.kv.metadata import AttentionMetadata
from tests.kernels.test_rotary import make_cache, split_qkv
from tests.kernels.ulp import NEAR_ZERO, assert_close_ulps

BLOCK_SIZE = 4


def run_both(seq_lens, tables, num_q, num_kv, head_dim, dtype, is_neox, num_splits, block_n, device="cpu",
             sliding_window=None, norm_hidden=None, head_norms=False, **launch):
    """(fused output, cache) and (reference output, cache) for one decode step whose new
    token of sequence i sits at position seq_lens[i] - 1 (a length of 0 is a padding row).
    With `norm_hidden`, q, k and v are still to be scaled by the inverse RMS of a random
    [seqs, norm_hidden] residual (a deferred input norm); the reference scales them first.
    With `head_norms`, q and k heads are RMS-normalised with random weights first (Qwen3's
    q_norm / k_norm); the reference runs `rms_norm_reference` on them."""
    generator = torch.Generator().manual_seed(sum(seq_lens) + head_dim)
    num_seqs = len(seq_lens)
    qkv = torch.randn(num_seqs, (num_q + 2 * num_kv) * head_dim, generator=generator).to(dtype).to(device)
    num_blocks = 1 + max(max(table) for table in tables if table)
    cache = torch.randn(2, num_blocks, BLOCK_SIZE, num_kv, head_dim, generator=generator).to(dtype).to(device)
    metadata = AttentionMetadata.build([1] * num_seqs, [max(n, 1) for n in seq_lens], tables, BLOCK_SIZE, device=device)
    padding = torch.tensor([length == 0 for length in seq_lens], device=device)
    metadata.seq_lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    slot_mapping = torch.where(padding, -1, metadata.slot_mapping)
    positions = torch.tensor([max(length - 1, 0) for length in seq_lens], device=device)
    cos_sin = make_cache(max(512, max(seq_lens) + 1), head_dim).to(device)  # every position rotated

    def split(data):
        q, k = split_qkv(data, num_q, num_kv, head_dim)
        v = data[:, (num_q + num_kv) * head_dim :].view(num_seqs, num_kv, head_dim)
        return q, k, v

    row_norm, ref_qkv = None, qkv.clone()
    if norm_hidden is not None:
        residual = (3.0 * torch.randn(num_seqs, norm_hidden, generator=generator)).to(dtype).to(device)
        row_norm = DeferredRMSNorm(residual, 1e-5)
        ref_qkv = (qkv.float() * inverse_rms_reference(residual, 1e-5)).to(dtype)
    norms = None
    if head_norms:
        norms = HeadNorms((torch.rand(head_dim, generator=generator) + 0.5).to(dtype).to(device),
                          (torch.rand(head_dim, generator=generator) + 0.5).to(dtype).to(device), 1e-6)
        q_ref, k_ref, _ = split(ref_qkv)
        q_ref.copy_(rms_norm_reference(q_ref.reshape(-1, head_dim), norms.q_weight, norms.eps).view(q_ref.shape))
        k_ref.copy_(rms_norm_reference(k_ref.reshape(-1, head_dim), norms.k_weight, norms.eps).view(k_ref.shape))
    fused_cache = cache.clone()
    q, k, v = split(qkv.clone())
    new_kv = NewKV(k, v, positions, cos_sin, slot_mapping, is_neox, row_norm=row_norm, head_norms=norms)
    out = paged_decode_attention(q, fused_cache, metadata, head_dim**-0.5, num_splits=num_splits, block_n=block_n,
                                 sliding_window=sliding_window, new_kv=new_kv, **launch)

    q_ref, k_ref, v_ref = split(ref_qkv)
    rotary_write_kv_reference(q_ref, k_ref, v_ref, positions, cos_sin, cache, slot_mapping, is_neox)
    expected = paged_attention_reference(q_ref, cache, metadata, head_dim**-0.5, sliding_window=sliding_window)
    return (out, fused_cache), (expected, cache)


@pytest.mark.parametrize(
    ("dtype", "is_neox", "num_splits"),
    [(torch.float32, True, 4), (torch.float32, False, 1), (torch.bfloat16, True, 2), (torch.float32, True, 8)],
)
def test_rotates_writes_and_attends_like_the_two_step_reference(dtype, is_neox, num_splits):
    # seq 0 ends mid-block in its third tile, seq 1 is one token, seq 2 fills its tiles exactly,
    # seq 3 is a padding row (no write, zero output); 8 splits make the first tile prefetched.
    seq_lens = [23, 1, 16, 0]
    tables = [[9, 2, 7, 4, 11, 1], [5], [3, 8, 6, 10], [0]]
    (out, cache), (expected, cache_ref) = run_both(seq_lens, tables, 4, 2, 16, dtype, is_neox, num_splits, block_n=8)

    tolerance = {"atol": 2e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 3e-2, "rtol": 3e-2}
    torch.testing.assert_close(out[:3].float(), expected[:3].float(), **tolerance)
    assert torch.count_nonzero(out[3]) == 0
    # the new keys (rotated) and values landed in their slots; nothing else moved
    assert_close_ulps(cache, cache_ref, atol=NEAR_ZERO)
    assert torch.equal(cache[1], cache_ref[1])


def test_sliding_window_sees_the_new_token():
    seq_lens = [19, 6]
    tables = [[4, 1, 6, 2, 8], [3, 5]]
    (out, cache), (expected, cache_ref) = run_both(seq_lens, tables, 2, 1, 16, torch.float32, True, 4, block_n=4,
                                                   sliding_window=7)
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=1e-5)
    assert_close_ulps(cache, cache_ref, atol=NEAR_ZERO)


@pytest.mark.parametrize(("num_splits", "launch"), [(2, {}), (4, {"heads_first": False, "prefetch": True})])
def test_deferred_input_norm_scales_q_k_v_by_the_residual_rows(num_splits, launch):
    # norm_hidden 40: the inverse RMS is read in two 32-column steps, the second one masked
    seq_lens = [23, 1, 16, 0]
    tables = [[9, 2, 7, 4, 11, 1], [5], [3, 8, 6, 10], [0]]
    (out, cache), (expected, cache_ref) = run_both(seq_lens, tables, 4, 2, 16, torch.float32, True, num_splits,
                                                   block_n=8, norm_hidden=40, **launch)
    torch.testing.assert_close(out[:3], expected[:3], atol=2e-5, rtol=1e-5)
    assert torch.count_nonzero(out[3]) == 0
    assert_close_ulps(cache, cache_ref, atol=NEAR_ZERO)


@pytest.mark.parametrize(("dtype", "is_neox", "num_splits"),
                         [(torch.float32, True, 4), (torch.bfloat16, True, 8), (torch.float32, False, 1)])
def test_head_norms_normalise_q_and_k_before_the_rotation(dtype, is_neox, num_splits):
    """Qwen3's per-head q and k norms inside the kernel: the output and the written keys are
    the two-step reference's after `rms_norm` of each head (values are not normalised)."""
    seq_lens = [23, 1, 16, 0]
    tables = [[9, 2, 7, 4, 11, 1], [5], [3, 8, 6, 10], [0]]
    (out, cache), (expected, cache_ref) = run_both(seq_lens, tables, 4, 2, 16, dtype, is_neox, num_splits,
                                                   block_n=8, head_norms=True)
    tolerance = {"atol": 2e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 3e-2, "rtol": 3e-2}
    torch.testing.assert_close(out[:3].float(), expected[:3].float(), **tolerance)
    assert torch.count_nonzero(out[3]) == 0
    # bf16: the normalised and scaled heads (up to ~3) may each be an ulp off where the
    # interpreter truncates, and the rotation mixes two of them: two ulps at that scale
    assert_close_ulps(cache, cache_ref, atol=NEAR_ZERO if dtype == torch.float32 else 2 * 2**-6)
    (unnormed, _), _ = run_both(seq_lens, tables, 4, 2, 16, dtype, is_neox, num_splits, block_n=8)
    assert (unnormed[:3].float() - out[:3].float()).abs().max() > 0.05  # the norms matter here


def test_split_major_grid_matches_the_reference():
    seq_lens = [23, 1, 16]
    tables = [[9, 2, 7, 4, 11, 1], [5], [3, 8, 6, 10]]
    (out, cache), (expected, cache_ref) = run_both(seq_lens, tables, 4, 2, 16, torch.float32, False, 2,
                                                   block_n=8, heads_first=False)
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=1e-5)
    assert_close_ulps(cache, cache_ref, atol=NEAR_ZERO)


def test_rejects_partial_rotary_and_strided_heads():
    seq_lens, tables = [3], [[1]]
    metadata = AttentionMetadata.build([1], seq_lens, tables, BLOCK_SIZE)
    q, k = torch.zeros(1, 2, 16), torch.zeros(1, 1, 16)
    cache = torch.zeros(2, 2, BLOCK_SIZE, 1, 16)
    new_kv = NewKV(k, k, torch.tensor([2]), make_cache(8, 8), metadata.slot_mapping)
    with pytest.raises(ValueError, match="full-width rotary"):
        paged_decode_attention(q, cache, metadata, 0.25, new_kv=new_kv)
    strided_key = torch.zeros(1, 1, 32)[..., ::2]  # head dimension not contiguous
    new_kv = NewKV(strided_key, k, torch.tensor([2]), make_cache(8, 16), metadata.slot_mapping)
    with pytest.raises(ValueError, match="new_kv key and value"):
        paged_decode_attention(q, cache, metadata, 0.25, new_kv=new_kv)
    two_rows = DeferredRMSNorm(torch.ones(2, 32), 1e-6)  # one query token
    new_kv = NewKV(k, k, torch.tensor([2]), make_cache(8, 16), metadata.slot_mapping, row_norm=two_rows)
    with pytest.raises(ValueError, match="new_kv.row_norm.source has 2 rows for 1 rows"):
        paged_decode_attention(q, cache, metadata, 0.25, new_kv=new_kv)
    norms = HeadNorms(torch.ones(16), torch.ones(8), 1e-6)  # the key weight is not [head_dim]
    new_kv = NewKV(k, k, torch.tensor([2]), make_cache(8, 16), metadata.slot_mapping, head_norms=norms)
    with pytest.raises(ValueError, match="head_norms.k_weight must be \\[16\\]"):
        paged_decode_attention(q, cache, metadata, 0.25, new_kv=new_kv)
    both = NewKV(k, k, torch.tensor([2]), make_cache(8, 16), metadata.slot_mapping,
                 row_norm=DeferredRMSNorm(torch.ones(1, 32), 1e-6), head_norms=HeadNorms(torch.ones(16), torch.ones(16), 1e-6))
    with pytest.raises(ValueError, match="not both"):
        paged_decode_attention(q, cache, metadata, 0.25, new_kv=both)


@pytest.mark.gpu
@pytest.mark.parametrize("batch", [17, 64])
def test_gpu_llama_shapes_match_the_two_step_path(batch):
    generator = torch.Generator().manual_seed(batch)
    seq_lens = torch.randint(1, 300, (batch,), generator=generator).tolist()
    per_seq = [-(-length // BLOCK_SIZE) for length in seq_lens]
    ids = torch.randperm(sum(per_seq), generator=generator) + 1
    tables, start = [], 0
    for count in per_seq:
        tables.append(ids[start : start + count].tolist())
        start += count
    (out, cache), (expected, cache_ref) = run_both(seq_lens, tables, 32, 8, 64, torch.bfloat16, True, None,
                                                   block_n=64, device="cuda")
    torch.testing.assert_close(out.float(), expected.float(), atol=2e-2, rtol=2e-2)
    assert_close_ulps(cache, cache_ref, atol=NEAR_ZERO)
    # the deferred input norm of a 2048-wide residual, on both grid orders
    for heads_first in (False, True):
        (out, cache), (expected, cache_ref) = run_both(seq_lens, tables, 32, 8, 64, torch.bfloat16, True, None,
                                                       block_n=64, device="cuda", norm_hidden=2048,
                                                       heads_first=heads_first)
        torch.testing.assert_close(out.float(), expected.float(), atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(cache.float(), cache_ref.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
def test_gpu_qwen3_moe_shapes_with_head_norms_match_the_two_step_path():
    """Qwen3-30B-A3B's attention: 32 query heads over 4 KV heads of 128, q/k norms inside."""
    seq_lens = [1025, 700, 1]
    per_seq = [-(-length // BLOCK_SIZE) for length in seq_lens]
    ids = torch.randperm(sum(per_seq), generator=torch.Generator().manual_seed(3)) + 1
    tables, start = [], 0
    for count in per_seq:
        tables.append(ids[start : start + count].tolist())
        start += count
    (out, cache), (expected, cache_ref) = run_both(seq_lens, tables, 32, 4, 128, torch.bfloat16, True, None,
                                                   block_n=64, device="cuda", head_norms=True)
    torch.testing.assert_close(out.float(), expected.float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(cache.float(), cache_ref.float(), atol=2e-2, rtol=2e-2)
