"""cleave.model: HF config + safetensors loading, the Llama-family model (dense, and the
Qwen3-MoE / gpt-oss mixture-of-experts variants: `moe.py`, MXFP4 experts: `mxfp4.py`), the
tokenizer.

    config = ModelConfig.from_pretrained(path)          # config.json
    model = load_model(path, dtype, device)             # CausalLM, fused qkv / gate_up
    kv_cache = allocate_kv_cache(config, num_blocks, block_size, dtype, device)
    hidden = model(input_ids, positions, kv_cache, metadata)   # [T] -> [T, H]
    logits = model.compute_logits(hidden[last_token_rows])     # [N, V] float32
    tokenizer = Tokenizer.from_pretrained(path)

Exports resolve lazily, so the gateway imports `cleave.model.tokenizer` and
`cleave.model.text_config` without loading torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "SUPPORTED_ARCHITECTURES": "cleave.model.config",
    "ModelConfig": "cleave.model.config",
    "CausalLM": "cleave.model.llama",
    "allocate_kv_cache": "cleave.model.llama",
    "CheckpointError": "cleave.model.loader",
    "empty_model": "cleave.model.loader",
    "load_hf_state_dict": "cleave.model.loader",
    "load_model": "cleave.model.loader",
    "TextConfig": "cleave.model.text_config",
    "Tokenizer": "cleave.model.tokenizer",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'cleave.model' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
