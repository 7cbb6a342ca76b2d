"""cleave: disaggregated prefill/decode LLM serving for reasoning models."""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"

# `import cleave` stays cheap (the CLI imports it on every health probe); these load on use.
_LAZY = {"LLM": "cleave.engine.llm", "SamplingParams": "cleave.generation.sampling_params"}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'cleave' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
