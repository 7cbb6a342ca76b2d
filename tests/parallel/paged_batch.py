"""Greedy generation of a batch of prompts straight through a model and a KV cache in the
engine's paged layout, without the engine: the TP=1 reference and every tensor-parallel
rank run this same code, so their results compare one to one."""

from __future__ import annotations

from typing import Any

import torch

from cleave.kv.metadata import AttentionMetadata
from cleave.model.llama import CausalLM, allocate_kv_cache

BLOCK_SIZE = 16
NUM_BLOCKS = 32


@torch.inference_mode()
def greedy_paged(
    model: CausalLM, prompts: list[list[int]], max_new_tokens: int, device: str = "cpu"
) -> dict[str, Any]:
    """Prefill every prompt in one batch, then decode them together for max_new_tokens - 1
    more steps. Returns the prompt logits [sum(prompt lens), V], the logits of each decode
    step [B, V], the generated tokens per prompt and the KV cache
    [L, 2, NUM_BLOCKS, BLOCK_SIZE, Hkv, D] (Hkv: the model's, a rank's share under TP), all
    on the host."""
    kv_cache = allocate_kv_cache(model.config, NUM_BLOCKS, BLOCK_SIZE, device=device)
    # blocks handed out from the top down, so tables are neither contiguous nor start at 1
    free = list(range(NUM_BLOCKS - 1, 0, -1))
    tables = []
    for prompt in prompts:
        needed = -(-(len(prompt) + max_new_tokens) // BLOCK_SIZE)
        tables.append([free.pop(0) for _ in range(needed)])
    lens = [len(prompt) for prompt in prompts]
    metadata = AttentionMetadata.build(lens, lens, tables, BLOCK_SIZE, device)
    input_ids = torch.tensor([token for prompt in prompts for token in prompt], device=device)
    positions = torch.cat([torch.arange(length) for length in lens]).to(device)
    prompt_logits = model.compute_logits(model(input_ids, positions, kv_cache, metadata))  # [T, V]
    last_rows = torch.tensor(lens, device=device).cumsum(0) - 1
    next_tokens = prompt_logits[last_rows].argmax(dim=-1)  # [B]
    generated = [[int(token)] for token in next_tokens]
    decode_logits = []
    for _ in range(max_new_tokens - 1):
        lens = [length + 1 for length in lens]
        metadata = AttentionMetadata.build([1] * len(prompts), lens, tables, BLOCK_SIZE, device)
        positions = torch.tensor(lens, device=device) - 1
        logits = model.compute_logits(model(next_tokens, positions, kv_cache, metadata))  # [B, V]
        next_tokens = logits.argmax(dim=-1)
        for tokens, token in zip(generated, next_tokens):
            tokens.append(int(token))
        decode_logits.append(logits.cpu())
    return {
        "prompt_logits": prompt_logits.cpu(), "decode_logits": decode_logits, "tokens": generated,
        "kv_cache": kv_cache.cpu(),
    }
