"""transformers' greedy continuations: the oracle the engine tests compare against."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch


def hf_greedy_continuations(
    checkpoint: Path, make_prompts: Callable[[int], list[list[int]]], max_tokens: int, **generate: object
) -> tuple[list[list[int]], list[list[int]]]:
    """The prompts (`make_prompts(vocab_size)`) and transformers' fp32 greedy continuation
    of each, `max_tokens` long (eos disabled; `generate`: more of `generate`'s options, e.g.
    its repetition penalty)."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    prompts = make_prompts(model.config.vocab_size)
    outputs = []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens, do_sample=False,
                                 **generate)
            outputs.append(out[0, len(prompt) :].tolist())
    return prompts, outputs
