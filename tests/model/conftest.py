"""Tiny checkpoints written once per test session, with their transformers twins."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from cleave.testing.tiny_models import ARCHITECTURES, write_tiny_checkpoint

@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Every architecture in its default embedding layout, plus Llama with tied embeddings and
    Mistral with a sliding window shorter than the test prompts."""
    root = tmp_path_factory.mktemp("tiny")
    paths = {arch: write_tiny_checkpoint(root / arch, arch, seed=index) for index, arch in enumerate(ARCHITECTURES)}
    paths["llama-tied"] = write_tiny_checkpoint(root / "llama-tied", "llama", seed=7, tie_word_embeddings=True)
    paths["mistral-window"] = write_tiny_checkpoint(root / "mistral-window", "mistral", seed=8, sliding_window=6)
    return paths


@pytest.fixture(scope="session")
def hf_models(tiny_checkpoints: dict[str, Path]) -> dict[str, torch.nn.Module]:
    import transformers

    return {
        name: transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        for name, path in tiny_checkpoints.items()
    }
