"""cleave.model: HF config + safetensors loading, the Llama-family model, the tokenizer.

    config = ModelConfig.from_pretrained(path)          # config.json
    model = load_model(path, dtype, device)             # CausalLM, fused qkv / gate_up
    kv_cache = allocate_kv_cache(config, num_blocks, block_size, dtype, device)
    hidden = model(input_ids, positions, kv_cache, metadata)   # [T] -> [T, H]
    logits = model.compute_logits(hidden[last_token_rows])     # [N, V] float32
    tokenizer = Tokenizer.from_pretrained(path)
"""

from cleave.model.config import SUPPORTED_ARCHITECTURES, ModelConfig
from cleave.model.llama import CausalLM, allocate_kv_cache
from cleave.model.loader import CheckpointError, empty_model, load_hf_state_dict, load_model
from cleave.model.tokenizer import Tokenizer

__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "CausalLM",
    "CheckpointError",
    "ModelConfig",
    "Tokenizer",
    "allocate_kv_cache",
    "empty_model",
    "load_hf_state_dict",
    "load_model",
]
