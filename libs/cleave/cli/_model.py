"""The checkpoint a `cleave` command serves: `--model DIR`, or the shipped reasoner."""

from __future__ import annotations

from pathlib import Path

from cleave.config import SHIPPED_MODEL_DIR


class ModelNotFound(Exception):
    """`--model` names no usable checkpoint directory; the message says which and why."""


def model_dir(model_arg: str | None) -> Path:
    """The checkpoint directory for `--model` (None: the shipped reasoner); raises
    ModelNotFound with a one-line reason when there is none to load."""
    if not model_arg:
        if not (SHIPPED_MODEL_DIR / "config.json").is_file():
            raise ModelNotFound(f"no --model given and no shipped model in {SHIPPED_MODEL_DIR}")
        return SHIPPED_MODEL_DIR
    path = Path(model_arg)
    if not path.is_dir():
        raise ModelNotFound(f"--model {model_arg}: no such directory")
    if not (path / "config.json").is_file():
        raise ModelNotFound(f"--model {model_arg}: not a checkpoint directory (it has no config.json); give a "
                            "directory with config.json, the *.safetensors weights and the tokenizer files")
    return path
