"""`ModelConfig`: the parts of a Hugging Face `config.json` that cleave's model reads.

Both config generations are understood: transformers 4 (`rope_theta` + `rope_scaling`,
`torch_dtype`) and transformers 5 (`rope_parameters`, `dtype`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from cleave.model.text_config import SUPPORTED_ARCHITECTURES, TextConfig, architecture_of, read_config_json

# Architectures whose q/k/v projections always carry a bias (Qwen2 has no config flag for it).
_ALWAYS_QKV_BIAS = {"Qwen2ForCausalLM"}
# Architectures that RMS-normalise every q and k head before rotary.
_QK_NORM = {"Qwen3ForCausalLM", "Qwen3MoeForCausalLM"}
# Quantised checkpoints cleave can load, per architecture (weights dequantised at load).
_QUANTIZATIONS = {"GptOssForCausalLM": ("mxfp4",)}

_DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float": torch.float32,
    "half": torch.float16,
}


@dataclass(frozen=True)
class ModelConfig:
    """Shape and numerics of a decoder-only causal LM (Llama, Mistral, Qwen2, Qwen3).

    `rope_scaling` is None for plain rotary, else a dict with at least `rope_type`
    (`linear` or `llama3`) and that type's parameters. `eos_token_ids` holds every id the
    config names as end-of-sequence (HF allows a single id or a list). `sliding_window` W
    (Mistral's; Qwen's only with use_sliding_window) limits each query to its last W
    positions in every layer, or only in the layers `layer_types` marks
    "sliding_attention" (gpt-oss). When every layer slides by the same W, the engine frees
    the KV blocks behind the window as generation moves (`KVCacheManager.drop_outside_window`);
    with any full-attention layer every block is kept.

    Mixture-of-experts models (Qwen3-MoE, gpt-oss) set `num_experts` > 0: the layers in
    `moe_layers` replace the dense MLP with a router over `num_experts` experts of width
    `moe_intermediate_size`, `num_experts_per_tok` of them per token, their weights
    renormalised to sum to one when `norm_topk_prob`. gpt-oss adds biases (`o_proj_bias`,
    `router_bias`, `expert_bias`), a clamped SwiGLU (`swiglu_limit`, `swiglu_alpha`), and
    per-head attention sinks; `quantization` names the format its expert weights are stored
    in ("mxfp4"), dequantised at load unless `packed_experts` (set by the loader when asked:
    the experts stay MXFP4 in memory, `cleave.kernels.mxfp4.MXFP4Weight`).
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    qk_norm: bool = False
    dtype: torch.dtype = torch.float32
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    sliding_window: int | None = None
    layer_types: tuple[str, ...] | None = None
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    moe_layers: tuple[int, ...] = ()
    attention_sinks: bool = False
    o_proj_bias: bool = False
    router_bias: bool = False
    expert_bias: bool = False
    swiglu_limit: float | None = None
    swiglu_alpha: float = 1.702
    quantization: str | None = None
    packed_experts: bool = False

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {self.architecture!r}; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )

        if self.layer_types is not None and len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(
                f"layer_types names {len(self.layer_types)} layers, the model has {self.num_hidden_layers}"
            )
        if self.packed_experts and self.quantization != "mxfp4":
            raise ValueError(f"packed_experts needs MXFP4 experts (quantization 'mxfp4'), got {self.quantization!r}")
        if self.moe_layers and not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ValueError(
                f"num_experts_per_tok ({self.num_experts_per_tok}) must be in 1..num_experts ({self.num_experts})"
            )

    def layer_sliding_window(self, layer: int) -> int | None:
        """The sliding window of layer `layer` (None: full attention)."""
        if self.layer_types is None:
            return self.sliding_window
        return self.sliding_window if self.layer_types[layer] == "sliding_attention" else None

    @property
    def is_moe(self) -> bool:
        return bool(self.moe_layers)

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @classmethod
    def from_pretrained(cls, path: str | Path) -> "ModelConfig":
        """Read `config.json` from a checkpoint directory (or the file itself)."""
        return cls.from_dict(read_config_json(path))

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "ModelConfig":
        """Build from the parsed contents of an HF `config.json`."""
        architecture = architecture_of(raw)
        try:
            return cls._from_dict(architecture, raw)
        except KeyError as missing:
            raise ValueError(f"config.json of a {architecture} has no {missing.args[0]!r}") from None

    @classmethod
    def _from_dict(cls, architecture: str, raw: dict[str, Any]) -> "ModelConfig":
        """`from_dict` of a supported architecture (a missing field raises KeyError)."""
        if raw.get("hidden_act", "silu") != "silu":
            raise ValueError(f"{architecture} with hidden_act={raw['hidden_act']!r} is not supported (only silu)")
        if raw.get("mlp_bias"):
            raise ValueError(f"{architecture} with mlp_bias=True is not supported")
        num_heads = raw["num_attention_heads"]
        rope_theta, rope_scaling = _read_rope(raw)
        text = TextConfig.from_dict(raw)
        dtype_name = raw.get("dtype") or raw.get("torch_dtype") or "float32"
        if dtype_name not in _DTYPES:
            raise ValueError(f"unsupported dtype {dtype_name!r} in config.json")
        sliding_window = raw.get("sliding_window")
        if architecture.startswith("Qwen") and not raw.get("use_sliding_window", False):
            sliding_window = None
        layer_types = None
        if architecture == "GptOssForCausalLM":  # transformers' default: sliding, full, sliding, ...
            layer_types = raw.get("layer_types") or [
                "sliding_attention" if (index + 1) % 2 else "full_attention"
                for index in range(raw["num_hidden_layers"])
            ]
        return cls(
            **_read_moe(architecture, raw),
            architecture=architecture,
            vocab_size=text.vocab_size,
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_hidden_layers=raw["num_hidden_layers"],
            num_attention_heads=num_heads,
            num_key_value_heads=raw.get("num_key_value_heads") or num_heads,
            head_dim=raw.get("head_dim") or raw["hidden_size"] // num_heads,
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=text.max_position_embeddings,
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=architecture in _ALWAYS_QKV_BIAS or bool(raw.get("attention_bias", False)),
            qk_norm=architecture in _QK_NORM,
            dtype=_DTYPES[dtype_name],
            bos_token_id=text.bos_token_id,
            eos_token_ids=text.eos_token_ids,
            sliding_window=sliding_window,
            layer_types=tuple(layer_types) if layer_types else None,
        )


def _read_moe(architecture: str, raw: dict[str, Any]) -> dict[str, Any]:
    """The mixture-of-experts and gpt-oss fields of `ModelConfig` (none for dense models),
    after refusing any quantisation the architecture cannot load."""
    quantization = raw.get("quantization_config")
    method = None
    if quantization:
        method = quantization.get("quant_method") if isinstance(quantization, dict) else None
        supported = _QUANTIZATIONS.get(architecture, ())
        if method not in supported:
            raise ValueError(
                f"{architecture} with quantization_config quant_method={method!r} is not supported"
                + (f" (supported: {', '.join(supported)})" if supported else "; use an unquantised checkpoint")
            )
    num_layers = raw["num_hidden_layers"]
    if architecture == "Qwen3MoeForCausalLM":
        num_experts = raw.get("num_experts") or raw.get("num_local_experts") or 0
        step = raw.get("decoder_sparse_step", 1) or 1
        dense_only = set(raw.get("mlp_only_layers") or ())
        moe_layers = tuple(
            index for index in range(num_layers)
            if num_experts > 0 and index not in dense_only and (index + 1) % step == 0
        )
        return dict(
            num_experts=num_experts, num_experts_per_tok=raw.get("num_experts_per_tok", 0),
            moe_intermediate_size=raw.get("moe_intermediate_size", 0),
            norm_topk_prob=bool(raw.get("norm_topk_prob", False)), moe_layers=moe_layers,
        )
    if architecture == "GptOssForCausalLM":
        return dict(
            num_experts=raw["num_local_experts"], num_experts_per_tok=raw["num_experts_per_tok"],
            moe_intermediate_size=raw["intermediate_size"], norm_topk_prob=True,
            moe_layers=tuple(range(num_layers)), attention_sinks=True,
            o_proj_bias=bool(raw.get("attention_bias", True)), router_bias=True, expert_bias=True,
            swiglu_limit=float(raw.get("swiglu_limit", 7.0)), swiglu_alpha=float(raw.get("swiglu_alpha", 1.702)),
            quantization=method,
        )
    return {}


def _read_rope(raw: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, rope_scaling or None) from either config generation."""
    params = raw.get("rope_parameters")
    if isinstance(params, dict) and params:
        scaling = dict(params)
    else:
        scaling = dict(raw.get("rope_scaling") or {})
    rope_theta = float(scaling.pop("rope_theta", raw.get("rope_theta", 10000.0)))
    # transformers 4 wrote the kind as "type"; 5 writes "rope_type".
    rope_type = scaling.pop("rope_type", None) or scaling.pop("type", None) or "default"
    scaling.pop("type", None)
    if rope_type == "default":
        return rope_theta, None
    return rope_theta, {"rope_type": rope_type, **scaling}
