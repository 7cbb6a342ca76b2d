"""Fixtures: the stack as separate processes (via `cleave up`'s launcher) on a tiny model."""

from __future__ import annotations

import json

import pytest

from cleave.cli._stack import ProcessStack, StackSpec
from cleave.testing.tiny_models import write_tiny_checkpoint

NUM_KV_BLOCKS = 256
# A guard against a hang, not a wait: the stack is up once every service reports SERVING (or
# fails as soon as one exits), however long a loaded machine takes to import and load.
START_HANG_S = 600


@pytest.fixture(scope="session")
def e2e_model(tmp_path_factory):
    directory = write_tiny_checkpoint(tmp_path_factory.mktemp("e2e") / "model")
    (directory / "cleave_config.json").write_text(json.dumps(
        {"reasoning": {"start_tag": "<think>", "end_tag": "</think>", "starts_in_reasoning": True}}))
    return directory


@pytest.fixture(scope="module", params=["disaggregated", "colocated"])
def process_stack(request, e2e_model, tmp_path_factory):
    # the kvstore path from one block on: the tests' prompts are a few blocks long
    spec = StackSpec(model=e2e_model, mode=request.param, grpc_port=0, http_port=0, num_kv_blocks=NUM_KV_BLOCKS,
                     log_level="WARNING", worker_args=("--kvstore-min-prefix-tokens", "1"))
    stack = ProcessStack(spec, tmp_path_factory.mktemp(f"stack-{request.param}"))
    stack.start(timeout_s=START_HANG_S)
    yield stack
    stack.stop()
    assert [child.process.returncode for child in stack.children] == [0] * len(stack.children)
