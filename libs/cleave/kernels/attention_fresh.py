"""A lone prompt with nothing cached before it, attended by torch's dense causal SDPA.

A step that prefills one prompt from its first token (the common long-prompt case: an 8k
prompt's first chunk) has every key it attends in the tensors it just wrote to the cache, in
order. There the paged prefill kernel's work (gathering each K/V tile through the block
table) buys nothing, and torch's `scaled_dot_product_attention` runs the device's flash
attention over contiguous tensors instead. The keys and values are gathered back from the
cache slots the step wrote (`metadata.slot_mapping`), so they are the rotated ones, in one
index per tensor; the KV heads are repeated for the query heads (as transformers' SDPA path
does), which keeps the flash backend eligible, or left as they are for SDPA's `enable_gqa`
(`gqa=True`). `backend` picks SDPA's kernel (`SDPA_BACKENDS`; "auto": torch's own choice).

`lone_fresh_prompt` says when this applies: one sequence whose query length is its context
and the batch's token count (no padding), no sliding window, no sinks, a cache in the
queries' dtype (not fp8), and not while a CUDA graph is being captured (a captured prefill
graph replays for prompts with a cached prefix as well). `PrefillLaunch.dense_fresh` turns it
on for a layer (`cleave.kernels.attention.paged_attention`).
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from cleave.kv.metadata import AttentionMetadata

SDPA_BACKENDS = {
    "flash": SDPBackend.FLASH_ATTENTION,
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "math": SDPBackend.MATH,
}


def lone_fresh_prompt(
    query: torch.Tensor,  # [T, Hq, D]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, Hkv, D]
    metadata: AttentionMetadata,
    sliding_window: int | None,
    sinks: torch.Tensor | None,
) -> bool:
    """Whether this batch is one prompt with no cached prefix that dense attention can take."""
    return (metadata.num_seqs == 1 and metadata.max_query_len == metadata.max_seq_len == query.shape[0]
            and sliding_window is None and sinks is None and kv_cache.dtype == query.dtype
            and not (query.is_cuda and torch.cuda.is_current_stream_capturing()))


def fresh_prompt_attention(
    query: torch.Tensor,  # [T, Hq, D]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, Hkv, D], the prompt's K/V already written
    metadata: AttentionMetadata,
    scale: float,
    backend: str = "auto",
    gqa: bool = False,
) -> torch.Tensor:  # [T, Hq, D]
    """Causal attention of a lone fresh prompt (`lone_fresh_prompt`) over its own keys and values."""
    if backend != "auto" and backend not in SDPA_BACKENDS:
        raise ValueError(f"backend must be 'auto' or one of {sorted(SDPA_BACKENDS)}, got {backend!r}")
    num_tokens, num_q_heads, head_dim = query.shape
    num_kv_heads = kv_cache.shape[3]
    slots = metadata.slot_mapping[:num_tokens]
    key, value = (kv_cache[i].reshape(-1, num_kv_heads, head_dim).index_select(0, slots) for i in (0, 1))
    if not gqa and num_q_heads != num_kv_heads:  # [T, Hkv, D] -> [T, Hq, D]
        key, value = (t.repeat_interleave(num_q_heads // num_kv_heads, dim=1) for t in (key, value))
    with contextlib.nullcontext() if backend == "auto" else sdpa_kernel(SDPA_BACKENDS[backend]):
        out = F.scaled_dot_product_attention(
            query.transpose(0, 1)[None], key.transpose(0, 1)[None], value.transpose(0, 1)[None], is_causal=True,
            scale=scale, enable_gqa=gqa,
        )  # [1, Hq, T, D]
    return out[0].transpose(0, 1)
