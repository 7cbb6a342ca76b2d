"""Paged attention over the block-structured KV cache: KV write, prefill and decode.

Torch references live here; Triton kernels sit in their own files (`kv_write.py`,
`attention_prefill.py`, `attention_decode.py`) and are picked by the public functions
(`write_kv`, `paged_attention`) following the `impl` convention of `dispatch.py`.
"""

from __future__ import annotations

import torch
import triton

from cleave.kernels.attention_decode import (
    HEADS_FIRST_MIN_SEQS,
    MAX_SPLITS,
    choose_num_splits,
    decode_num_warps,
    merge_block_s,
    paged_decode_attention,
)
from cleave.kernels.attention_fresh import fresh_prompt_attention, lone_fresh_prompt
from cleave.kernels.attention_prefill import DEFAULT_PREFILL_LAUNCH, PrefillLaunch, paged_prefill_attention
from cleave.kernels.dispatch import Impl, use_triton
from cleave.kernels.kv_cache_dtype import to_cache_dtype
from cleave.kernels.kv_write import write_kv_triton
from cleave.kv.metadata import AttentionMetadata


def write_kv_reference(
    key: torch.Tensor,  # [T, Hkv, D]
    value: torch.Tensor,  # [T, Hkv, D]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, Hkv, D]
    slot_mapping: torch.Tensor,  # [T] int64, -1 = padding
) -> None:
    """Scatter new K/V into their slots, cast as the cache stores them (`to_cache_dtype`: an
    fp8 cache saturates); padding slots (-1) are skipped."""
    num_blocks, block_size = kv_cache.shape[1], kv_cache.shape[2]
    valid = slot_mapping >= 0
    slots = slot_mapping[valid]
    flat = kv_cache.view(2, num_blocks * block_size, kv_cache.shape[3], kv_cache.shape[4])
    flat[0, slots] = to_cache_dtype(key[valid], kv_cache.dtype)
    flat[1, slots] = to_cache_dtype(value[valid], kv_cache.dtype)


def paged_attention_reference(
    query: torch.Tensor,  # [T, Hq, D]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, Hkv, D]
    metadata: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
    sinks: torch.Tensor | None = None,  # [Hq]
) -> torch.Tensor:  # [T, Hq, D]
    """Causal attention of each sequence's new tokens over its cached context (GQA), in fp32
    over the dequantised cache (an fp8 cache's values are its scale-1.0 values); with a
    `sliding_window` W, the query at position i sees keys i - W + 1 .. i only; `sinks` adds
    one logit per query head to each softmax (a sink that takes weight and gives no value)."""
    block_size = kv_cache.shape[2]
    num_q_heads, num_kv_heads = query.shape[1], kv_cache.shape[3]
    group = num_q_heads // num_kv_heads
    out = torch.zeros_like(query)
    starts = metadata.query_start_loc.tolist()
    seq_lens = metadata.seq_lens.tolist()
    tables = metadata.block_tables.tolist()
    for b, seq_len in enumerate(seq_lens):
        q_start, q_end = starts[b], starts[b + 1]
        query_len = q_end - q_start
        if query_len == 0 or seq_len == 0:
            continue
        num_blocks = (seq_len + block_size - 1) // block_size
        blocks = torch.tensor(tables[b][:num_blocks], dtype=torch.long, device=query.device)
        keys = kv_cache[0, blocks].reshape(-1, num_kv_heads, kv_cache.shape[4])[:seq_len]
        values = kv_cache[1, blocks].reshape(-1, num_kv_heads, kv_cache.shape[4])[:seq_len]
        keys = keys.float().repeat_interleave(group, dim=1)  # [S, Hq, D]
        values = values.float().repeat_interleave(group, dim=1)
        q = query[q_start:q_end].float()  # [Q, Hq, D]
        scores = torch.einsum("qhd,khd->hqk", q, keys) * scale
        q_pos = torch.arange(seq_len - query_len, seq_len, device=query.device)
        k_pos = torch.arange(seq_len, device=query.device)
        mask = k_pos[None, :] > q_pos[:, None]  # [Q, S]
        if sliding_window:
            mask |= k_pos[None, :] <= q_pos[:, None] - sliding_window
        scores.masked_fill_(mask[None], float("-inf"))
        if sinks is not None:
            sink_column = sinks.float()[:, None, None].expand(-1, query_len, 1)  # [Hq, Q, 1]
            probs = torch.softmax(torch.cat([scores, sink_column], dim=-1), dim=-1)[..., :-1]
        else:
            probs = torch.softmax(scores, dim=-1)
        out[q_start:q_end] = torch.einsum("hqk,khd->qhd", probs, values).to(query.dtype)
    return out


def write_kv(
    key: torch.Tensor,  # [T, Hkv, D]
    value: torch.Tensor,  # [T, Hkv, D]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, Hkv, D]
    slot_mapping: torch.Tensor,  # [T] int64, -1 = padding
    impl: Impl = "auto",
) -> None:
    """Write new K/V into the paged cache (Triton on CUDA, torch otherwise)."""
    if use_triton(key, impl):
        write_kv_triton(key, value, kv_cache, slot_mapping)
    else:
        write_kv_reference(key, value, kv_cache, slot_mapping)


def paged_attention(
    query: torch.Tensor,  # [T, Hq, D]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, Hkv, D]
    metadata: AttentionMetadata,
    scale: float,
    impl: Impl = "auto",
    sliding_window: int | None = None,
    sinks: torch.Tensor | None = None,
    pdl: bool = True,
    prefill: PrefillLaunch = DEFAULT_PREFILL_LAUNCH,
) -> torch.Tensor:  # [T, Hq, D]
    """Attention of the batch's new tokens over the paged cache (Triton on CUDA).

    A decode-only batch (every query length 1) runs the split-KV decode kernel; any batch
    with a prefill chunk, mixed or not, runs the varlen prefill kernel, launched as `prefill`
    says (with `prefill.decode_rows`, a mixed batch's leading decodes,
    `metadata.num_decode_seqs`, run the decode kernel and the rest the prefill kernel; with
    `prefill.dense_fresh`, a batch that is one prompt with nothing cached before it runs
    torch's dense SDPA, `cleave.kernels.attention_fresh`). `sliding_window` (Mistral's): each
    query sees only its last W positions. `sinks`
    [Hq] (gpt-oss): one extra logit per query head in every softmax. `pdl`: see
    `cleave.kernels.pdl` (the decode kernel only).
    """
    if not use_triton(query, impl):
        return paged_attention_reference(query, kv_cache, metadata, scale, sliding_window, sinks)
    if metadata.is_decode_only:
        return paged_decode_attention(query, kv_cache, metadata, scale, sliding_window=sliding_window, sinks=sinks,
                                      pdl=pdl)
    if prefill.dense_fresh and lone_fresh_prompt(query, kv_cache, metadata, sliding_window, sinks):
        return fresh_prompt_attention(query, kv_cache, metadata, scale, prefill.dense_backend, prefill.dense_gqa)
    out = None
    num_decodes = metadata.num_decode_seqs if prefill.decode_rows else 0
    if num_decodes:
        splits = mixed_decode_splits(num_decodes, query.shape[1], kv_cache.shape[3], query.shape[2])
        out = paged_decode_attention(query, kv_cache, metadata.leading(num_decodes), scale, num_splits=splits,
                                     sliding_window=sliding_window, sinks=sinks, pdl=pdl)
    return paged_prefill_attention(query, kv_cache, metadata, scale, sliding_window=sliding_window, sinks=sinks,
                                   first_seq=num_decodes, out=out, **prefill.kernel_options())


# Contexts are not looked at when a mixed step's decodes choose their splits (see below).
_ANY_CONTEXT = 1 << 30


def mixed_decode_splits(num_decodes: int, num_q_heads: int, num_kv_heads: int, head_dim: int) -> int:
    """Split count of a mixed step's leading decodes: from their number alone, rounded down
    to a power of four. The split count is a constexpr of the decode kernel, so each value is
    a compiled variant; chosen from the decodes' contexts as well (as for a decode-only
    batch) it met new variants step after step as contexts grew (five compiles, 4.2 s, in one
    engine run). From the count alone there are four or five, compiled at start-up
    (`warm_mixed_decodes`). Splits past a short context exit at once."""
    group = num_q_heads // num_kv_heads
    warps = decode_num_warps(head_dim, num_decodes, group)  # as paged_decode_attention launches them
    merge_chunk = merge_block_s(group, triton.next_power_of_2(head_dim), MAX_SPLITS, warps)
    splits = choose_num_splits(num_decodes, num_kv_heads, _ANY_CONTEXT, merge_chunk=merge_chunk)
    return 1 << (2 * ((splits.bit_length() - 1) // 2))


def mixed_decode_variants(max_decodes: int, num_q_heads: int, num_kv_heads: int, head_dim: int) -> list[int]:
    """One decode count for each decode-kernel variant a mixed step of up to `max_decodes`
    decodes can launch (its split count, grid order and warps)."""
    counts: dict[tuple[int, bool, int], int] = {}
    for count in range(1, max_decodes + 1):
        key = (mixed_decode_splits(count, num_q_heads, num_kv_heads, head_dim), count >= HEADS_FIRST_MIN_SEQS,
               decode_num_warps(head_dim, count, num_q_heads // num_kv_heads))
        counts.setdefault(key, count)
    return sorted(counts.values())


def warm_mixed_decodes(
    query: torch.Tensor,  # [max_decodes, Hq, D], laid out as the layer's queries are (a view of its qkv)
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, Hkv, D]
    scale: float,
    sliding_window: int | None = None,
    sinks: torch.Tensor | None = None,
    pdl: bool = True,
) -> int:
    """Launch the decode kernel once per variant a mixed step's decodes can take (sequences of
    one token in the null block 0: nothing is written), so their compiles happen at start-up
    and not in a serving step. Returns the number of launches."""
    num_q_heads, num_kv_heads, head_dim = query.shape[1], kv_cache.shape[3], query.shape[2]
    counts = mixed_decode_variants(query.shape[0], num_q_heads, num_kv_heads, head_dim)
    for count in counts:
        metadata = AttentionMetadata.build([1] * count, [1] * count, [[0]] * count, kv_cache.shape[2], query.device)
        splits = mixed_decode_splits(count, num_q_heads, num_kv_heads, head_dim)
        paged_decode_attention(query, kv_cache, metadata.leading(count), scale, num_splits=splits,
                               sliding_window=sliding_window, sinks=sinks, pdl=pdl)  # as `paged_attention` does
    return len(counts)
