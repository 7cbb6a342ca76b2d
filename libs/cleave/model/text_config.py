"""`TextConfig`: the parts of a Hugging Face `config.json` that text processing needs.

The gateway tokenizes and streams text but never loads weights, so it reads the vocabulary
size, the context length and the end-of-sequence ids here, without torch. `ModelConfig`
takes the same fields from `TextConfig.from_dict`, so both read `config.json` one way.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any


SUPPORTED_ARCHITECTURES: tuple[str, ...] = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM",
    "GptOssForCausalLM",
)


def architecture_of(raw: dict[str, Any]) -> str:
    """The one architecture a parsed `config.json` names; ValueError naming the supported
    ones when it names another, several or none (checked before any other field is read)."""
    architectures = raw.get("architectures") or []
    supported = ", ".join(SUPPORTED_ARCHITECTURES)
    if len(architectures) != 1:
        raise ValueError(f"config.json must name exactly one architecture, got {architectures!r}; "
                         f"supported: {supported}")
    if architectures[0] not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"unsupported architecture {architectures[0]!r}; supported: {supported}")
    return architectures[0]


def read_config_json(path: str | Path) -> dict[str, Any]:
    """The parsed `config.json` of a checkpoint directory (or the file itself)."""
    path = Path(path)
    config_file = path / "config.json" if path.is_dir() else path
    if not config_file.is_file():
        raise FileNotFoundError(f"no config.json at {config_file}")
    with open(config_file, encoding="utf-8") as f:
        return json.load(f)


@dataclass(frozen=True)
class TextConfig:
    """Vocabulary, context and special tokens of a checkpoint.

    `eos_token_ids` holds every id the config names as end-of-sequence (HF allows a single
    id or a list).
    """

    vocab_size: int
    max_position_embeddings: int = 2048
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    @classmethod
    def from_pretrained(cls, path: str | Path) -> TextConfig:
        """Read `config.json` from a checkpoint directory (or the file itself)."""
        return cls.from_dict(read_config_json(path))

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> TextConfig:
        """Build from the parsed contents of an HF `config.json`."""
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        return cls(
            vocab_size=raw["vocab_size"],
            max_position_embeddings=raw.get("max_position_embeddings", 2048),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )
