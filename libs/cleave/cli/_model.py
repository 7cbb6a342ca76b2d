"""The checkpoint a `cleave` command serves: `--model DIR` or `ORG/NAME[@REVISION]` (a Hugging
Face Hub id, through `cleave.model.source`), or the shipped reasoner."""

from __future__ import annotations

from pathlib import Path

from cleave.config import SHIPPED_MODEL_DIR
from cleave.model.source import ModelNotFound, hub_id, resolve_model_dir

__all__ = ["ModelNotFound", "model_dir", "served_name"]


def model_dir(model_arg: str | None) -> Path:
    """The checkpoint directory for `--model` (None: the shipped reasoner); raises
    ModelNotFound with a one-line reason when there is none to load."""
    return resolve_model_dir(model_arg or "", SHIPPED_MODEL_DIR)


def served_name(model_arg: str | None, directory: Path) -> str:
    """The id clients use for a model by default: its Hub id (without the revision), else
    the directory's name."""
    if model_arg and not Path(model_arg).expanduser().exists():
        parsed = hub_id(model_arg)
        if parsed is not None:
            return parsed[0]
    return directory.name
