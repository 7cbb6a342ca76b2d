"""One prompt of a batch attended by torch's dense causal SDPA over its gathered context.

A step that prefills one prompt (the common long-prompt case: each chunk of an 8k prompt,
alone or after the batch's single-token decodes) has every key it attends in the paged
cache by the time attention runs: its cached prefix and the chunk it just wrote. The paged
prefill kernel gathers each K/V tile through the block table inside its loop; here the
prompt's context is gathered once into contiguous [S, Hkv, D] tensors (the rotated keys, as
cached) and torch's `scaled_dot_product_attention` runs the device's flash attention over
them. A query block shorter than its context is causal from the bottom right (query i of Q
sees keys 0 .. S - Q + i: `causal_lower_right`), which SDPA's flash kernel does natively.
The KV heads are repeated for the query heads (as transformers' SDPA path does), which keeps
the flash backend eligible, or left as they are for SDPA's `enable_gqa` (`gqa=True`).
`backend` picks SDPA's kernel (`SDPA_BACKENDS`; "auto": torch's own choice).

`dense_prompt` says when this applies: the batch is the leading single-token decodes it was
told of (`first_seq`; the decode kernel attends those) and then one prompt with no padding
after it, with its context length on the host (`AttentionMetadata.host_seq_lens`: the eager
batches); no sliding window, no sinks, a cache in the queries' dtype (not fp8), and not while
a CUDA graph is being captured (a captured graph replays for other prompts). A prompt with a
cached prefix also needs at least `DENSE_PREFIX_MIN_QUERIES` queries: gathering its context
costs two reads of the context's K/V, which a short query block does not earn back.
`PrefillLaunch.dense_fresh` (no cached prefix) and `dense_prefix` (with one) turn it on for a
layer (`cleave.kernels.attention.paged_attention`).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

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
# A prompt after a cached prefix takes the dense path from this many queries up: its gather
# reads and writes the context's K/V once (2 x S x Hkv x D x 2 x 2 bytes), while the
# attention does 4 x Q x S x Hq x D FLOPs; from a few hundred queries the FLOPs dominate.
DENSE_PREFIX_MIN_QUERIES = 256


@dataclass(frozen=True)
class DensePrompt:
    """Where the batch's one prompt sits: its sequence index and first query row (both
    `first_seq`: the rows before it are single-token decodes), its query count and context
    length (host ints)."""

    seq: int
    num_queries: int
    seq_len: int

    @property
    def has_prefix(self) -> bool:
        return self.seq_len > self.num_queries


def dense_prompt(
    query: torch.Tensor,  # [T, Hq, D]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, Hkv, D]
    metadata: AttentionMetadata,
    sliding_window: int | None,
    sinks: torch.Tensor | None,
    first_seq: int = 0,
    fresh: bool = True,
    prefix: bool = False,
) -> DensePrompt | None:
    """The batch's one prompt after its `first_seq` leading decodes, if dense attention can
    take it: without a cached prefix when `fresh`, with one when `prefix` (see the module doc)."""
    host_seq_lens = metadata.host_seq_lens
    num_queries = query.shape[0] - first_seq
    if (host_seq_lens is None or metadata.num_seqs != first_seq + 1 or num_queries < 1
            or metadata.max_query_len != num_queries or sliding_window is not None or sinks is not None
            or kv_cache.dtype != query.dtype or (query.is_cuda and torch.cuda.is_current_stream_capturing())):
        return None
    prompt = DensePrompt(first_seq, num_queries, host_seq_lens[first_seq])
    if prompt.has_prefix:
        return prompt if prefix and num_queries >= DENSE_PREFIX_MIN_QUERIES else None
    return prompt if fresh else None


def dense_prompt_attention(
    query: torch.Tensor,  # [T, Hq, D]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, Hkv, D], the prompt's K/V already written
    metadata: AttentionMetadata,
    prompt: DensePrompt,
    scale: float,
    backend: str = "auto",
    gqa: bool = False,
) -> torch.Tensor:  # [Q, Hq, D]: the prompt's rows
    """Causal attention of the prompt `dense_prompt` found over its whole context."""
    if backend != "auto" and backend not in SDPA_BACKENDS:
        raise ValueError(f"backend must be 'auto' or one of {sorted(SDPA_BACKENDS)}, got {backend!r}")
    num_q_heads, head_dim = query.shape[1:]
    block_size, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    seq_len, num_queries = prompt.seq_len, prompt.num_queries
    blocks = metadata.block_tables[prompt.seq, : -(-seq_len // block_size)].to(torch.int64)
    slots = (blocks[:, None] * block_size + torch.arange(block_size, device=blocks.device)).reshape(-1)[:seq_len]
    key, value = (kv_cache[i].reshape(-1, num_kv_heads, head_dim).index_select(0, slots) for i in (0, 1))
    if not gqa and num_q_heads != num_kv_heads:  # [S, Hkv, D] -> [S, Hq, D]
        key, value = (t.repeat_interleave(num_q_heads // num_kv_heads, dim=1) for t in (key, value))
    rows = query[prompt.seq : prompt.seq + num_queries]
    if prompt.has_prefix:
        from torch.nn.attention.bias import causal_lower_right  # imports torch._dynamo: only when used

        causal = {"attn_mask": causal_lower_right(num_queries, seq_len)}
    else:
        causal = {"is_causal": True}
    with contextlib.nullcontext() if backend == "auto" else sdpa_kernel(SDPA_BACKENDS[backend]):
        out = F.scaled_dot_product_attention(
            rows.transpose(0, 1)[None], key.transpose(0, 1)[None], value.transpose(0, 1)[None], scale=scale,
            enable_gqa=gqa, **causal,
        )  # [1, Hq, Q, D]
    return out[0].transpose(0, 1)
