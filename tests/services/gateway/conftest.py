"""Fixtures: a tiny reasoning checkpoint and in-process stacks over it (one per module)."""

from __future__ import annotations

import pytest
import pytest_asyncio

from cleave.testing.tiny_models import write_tiny_checkpoint
from tests.services.gateway.stack import start_stack, write_reasoning_config


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    """A random tiny Llama marked as a reasoning model (its prompt opens <think>)."""
    directory = write_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "model")
    write_reasoning_config(directory)
    return directory


@pytest_asyncio.fixture(scope="module", loop_scope="module", params=["disaggregated", "colocated"])
async def stack(request, model_dir):
    """The whole stack in this process, in each mode."""
    running = await start_stack(model_dir, request.param)
    yield running
    await running.close()
