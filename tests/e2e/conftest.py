"""Fixtures: the stack as separate processes (via `cleave up`'s launcher) on a tiny model."""

from __future__ import annotations

import json

import pytest

from cleave.cli._stack import ProcessStack, StackSpec
from cleave.testing.tiny_models import write_tiny_checkpoint

NUM_KV_BLOCKS = 256


@pytest.fixture(scope="session")
def e2e_model(tmp_path_factory):
    directory = write_tiny_checkpoint(tmp_path_factory.mktemp("e2e") / "model")
    (directory / "cleave_config.json").write_text(json.dumps(
        {"reasoning": {"start_tag": "<think>", "end_tag": "</think>", "starts_in_reasoning": True}}))
    return directory


@pytest.fixture(scope="module", params=["disaggregated", "colocated"])
def process_stack(request, e2e_model, tmp_path_factory):
    spec = StackSpec(model=e2e_model, mode=request.param, grpc_port=0, http_port=0, num_kv_blocks=NUM_KV_BLOCKS,
                     log_level="WARNING")
    stack = ProcessStack(spec, tmp_path_factory.mktemp(f"stack-{request.param}"))
    stack.start(timeout_s=90)
    yield stack
    stack.stop()
    assert [child.process.returncode for child in stack.children] == [0] * len(stack.children)
