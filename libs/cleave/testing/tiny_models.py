"""Tiny random HF checkpoints (Llama, Qwen2, Qwen3, Mistral, Qwen3-MoE, gpt-oss) with a locally
trained tokenizer.

`write_tiny_checkpoint` writes what a Hub checkpoint holds — config.json, safetensors
weights, tokenizer.json, tokenizer_config.json (with a chat template) and
generation_config.json — using transformers' own model classes, so tests can compare cleave
with transformers on the same files. Weights are random but seeded; norm weights and
projection biases are perturbed away from their 1/0 initial values so every parameter
matters for the logits.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import torch

ARCHITECTURES: tuple[str, ...] = ("llama", "qwen2", "qwen3", "mistral")
# Mixture-of-experts architectures (written by the same function, tested on their own).
MOE_ARCHITECTURES: tuple[str, ...] = ("qwen3-moe", "gpt-oss")

SPECIAL_TOKENS = ("<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>")
# Reasoning markers are added tokens but not special ones (as in Qwen3), so they survive
# `decode(skip_special_tokens=True)` for the reasoning parser to find.
THINK_TOKENS = ("<think>", "</think>")
TOKENIZER_VOCAB_SIZE = 512
# gpt-oss's SwiGLU limit and alpha as transformers releases up to at least 5.17 apply them,
# whatever config.json says (later releases read them from the config). The tiny checkpoint
# keeps these values, so every release computes the same function from it.
GPT_OSS_SWIGLU_LIMIT = 7.0
GPT_OSS_SWIGLU_ALPHA = 1.702

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] + eos_token + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)

_CORPUS = """\
The quick brown fox jumps over the lazy dog. A serving system turns prompts into tokens,
runs the model over them, and streams the answer back to the user as it is generated.
Prefill reads the whole prompt at once and is limited by arithmetic; decode produces one
token at a time and is limited by memory bandwidth. Keeping the two apart lets each run at
its best speed. The key and value cache holds what attention needs from earlier tokens, in
blocks of sixteen positions, so that memory is shared and reused without copying.
When a model thinks before it answers, it writes its reasoning between special markers and
then gives the final answer. Long reasoning can take thousands of tokens, so the cache must
grow block by block, and the scheduler must decide which requests run in each step.
Numbers: one two three four five six seven eight nine ten, 0 1 2 3 4 5 6 7 8 9 10 100 1000.
Questions and answers: What is the capital of France? Paris is the capital of France.
How many legs does a spider have? A spider has eight legs. Why is the sky blue? Because
air scatters blue light more than red light. Please write a short poem about the sea.
The sea is wide and deep and blue; it sings of storms and calm and you.
def add(a, b): return a + b  # code appears in prompts too, with (brackets) and {braces}.
Hello world! Good morning, good evening, thank you, you're welcome; it's fine, isn't it?
"""


@functools.lru_cache(maxsize=1)
def _trained_tokenizer_json() -> str:
    """Byte-level BPE trained on the built-in corpus, serialised (kept per process)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from tokenizers import AddedToken

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB_SIZE - len(THINK_TOKENS),
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_CORPUS.splitlines(), trainer)
    tokenizer.add_tokens([AddedToken(token, special=False, normalized=False) for token in THINK_TOKENS])
    bos_id = tokenizer.token_to_id("<s>")
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos_id)]
    )
    return tokenizer.to_str()


def _hf_config(architecture: str, vocab_size: int, bos_id: int, eos_id: int, overrides: dict[str, Any]):
    import transformers

    common: dict[str, Any] = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=2048,
        rms_norm_eps=1e-6,
        initializer_range=0.1,
        bos_token_id=bos_id,
        eos_token_id=eos_id,
    )
    if architecture == "llama":
        common.update(
            tie_word_embeddings=False,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 256,
            },
        )
        config_class = transformers.LlamaConfig
    elif architecture == "qwen2":
        common.update(tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
        config_class = transformers.Qwen2Config
    elif architecture == "qwen3":
        common.update(tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
        config_class = transformers.Qwen3Config
    elif architecture == "mistral":
        common.update(tie_word_embeddings=False, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
        config_class = transformers.MistralConfig
    elif architecture == "qwen3-moe":
        # three layers, the middle one dense: sparse and dense MLPs side by side
        common.update(
            tie_word_embeddings=False, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
            num_hidden_layers=3, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
            norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[1],
        )
        config_class = transformers.Qwen3MoeConfig
    elif architecture == "gpt-oss":
        # a 6-token window on the first layer, full attention on the second; a SwiGLU limit
        # the random activations cross (`write_tiny_checkpoint` scales the experts' gate/up)
        common.update(
            tie_word_embeddings=False, intermediate_size=32, num_local_experts=8, num_experts_per_tok=2,
            layer_types=["sliding_attention", "full_attention"], sliding_window=6,
            swiglu_limit=GPT_OSS_SWIGLU_LIMIT, swiglu_alpha=GPT_OSS_SWIGLU_ALPHA, attention_bias=True,
            rope_parameters={
                "rope_type": "yarn", "rope_theta": 150000.0, "factor": 8.0, "beta_fast": 32.0, "beta_slow": 1.0,
                "truncate": False, "original_max_position_embeddings": 256,
            },
        )
        config_class = transformers.GptOssConfig
    else:
        choices = ", ".join((*ARCHITECTURES, *MOE_ARCHITECTURES))
        raise ValueError(f"unknown tiny architecture {architecture!r}; choose from {choices}")
    common.update(overrides)
    return config_class(**common)


def write_tiny_checkpoint(
    directory: str | Path,
    architecture: str = "llama",
    *,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    max_shard_size: str | None = None,
    **overrides: Any,
) -> Path:
    """Write a random tiny HF checkpoint of `architecture` into `directory` and return it.

    `overrides` are passed to the transformers config class (e.g. tie_word_embeddings=True,
    num_hidden_layers=3). `max_shard_size` (e.g. "100KB") writes a sharded checkpoint with
    a `model.safetensors.index.json`.
    """
    import transformers
    from tokenizers import Tokenizer

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = Tokenizer.from_str(_trained_tokenizer_json())
    bos_id, eos_id = tokenizer.token_to_id("<s>"), tokenizer.token_to_id("</s>")
    config = _hf_config(architecture, tokenizer.get_vocab_size(with_added_tokens=True), bos_id, eos_id, overrides)

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = transformers.AutoModelForCausalLM.from_config(config)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith("norm.weight"):
                    param.add_(0.1 * torch.randn_like(param))
                elif name.endswith((".bias", "_bias")):
                    param.normal_(0.0, 0.1)
                elif name.endswith(("mlp.gate.weight", "router.weight", ".sinks")):
                    param.normal_(0.0, 0.5)  # distinct routing and sinks that matter
                if architecture == "gpt-oss" and name.endswith(("experts.gate_up_proj", "experts.gate_up_proj_bias")):
                    # gate/up cross the SwiGLU limit as often as unscaled ones would cross 1
                    param.mul_(config.swiglu_limit)
    model = model.to(dtype)
    save_kwargs: dict[str, Any] = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(directory, **save_kwargs)

    tokenizer.save(str(directory / "tokenizer.json"))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "model_max_length": config.max_position_embeddings,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2), encoding="utf-8")
    # A second stop token, as Llama 3 does: a model that starts a new user turn has finished.
    generation_config = {
        "bos_token_id": bos_id,
        "eos_token_id": [eos_id, tokenizer.token_to_id("<|user|>")],
        "do_sample": False,
    }
    (directory / "generation_config.json").write_text(json.dumps(generation_config, indent=2), encoding="utf-8")
    return directory


def write_mxfp4_twin(dense: str | Path, quantized: str | Path, seed: int = 0) -> Path:
    """Give a tiny gpt-oss checkpoint (`dense`, rewritten in place) random MXFP4-representable
    experts and write the same model to `quantized` with those experts as gpt-oss ships them:
    `*_blocks` [E, out, in / 32, 16] and `*_scales` [E, out, in / 32] uint8 (scales 2^-4..2^1),
    `quantization_config` naming mxfp4. Returns `quantized`."""
    from safetensors.torch import load_file, save_file

    from cleave.kernels.mxfp4 import dequantize_mxfp4

    dense, quantized = Path(dense), Path(quantized)
    quantized.mkdir(parents=True, exist_ok=True)
    for file in dense.iterdir():
        (quantized / file.name).write_bytes(file.read_bytes())
    tensors = load_file(dense / "model.safetensors")
    packed = dict(tensors)
    generator = torch.Generator().manual_seed(seed)
    for name in [name for name in tensors if name.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        experts, in_features, out_features = tensors[name].shape  # HF's stacked gpt-oss layout [E, in, out]
        groups = (experts, out_features, in_features // 32)
        blocks = torch.randint(0, 256, (*groups, 16), generator=generator, dtype=torch.uint8)
        scales = torch.randint(123, 129, groups, generator=generator, dtype=torch.uint8)
        tensors[name] = dequantize_mxfp4(blocks, scales, torch.float32).transpose(1, 2).contiguous()
        del packed[name]
        packed[f"{name}_blocks"], packed[f"{name}_scales"] = blocks, scales
    save_file(tensors, dense / "model.safetensors", metadata={"format": "pt"})
    save_file(packed, quantized / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((dense / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]}
    (quantized / "config.json").write_text(json.dumps(config))
    return quantized
