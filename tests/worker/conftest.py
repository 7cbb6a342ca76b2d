"""A tiny random Llama checkpoint shared by the worker tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from cleave.testing.tiny_models import write_tiny_checkpoint


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("worker-tiny") / "llama", "llama", seed=3)
