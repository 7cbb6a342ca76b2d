"""The shipped reasoner on the GPU: the model `cleave up --demo` and `cleave generate` start
with. Its positions end at 512, under the default step budget of 2048, so start-up must not
run a prompt past them (it read the rotary table out of bounds: an illegal address)."""

from __future__ import annotations

import gc

import pytest
import torch

from cleave.config import SHIPPED_MODEL_DIR
from cleave.engine.llm import LLM
from cleave.generation.sampling_params import SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def test_the_shipped_reasoner_starts_on_the_gpu_and_decodes_as_on_the_cpu():
    prompts = ["What is 1234 + 567?", "What is 9 * 8?"]
    params = SamplingParams(max_tokens=32, temperature=0.0)
    on_cpu = LLM(SHIPPED_MODEL_DIR, device="cpu").generate(prompts, params)

    # a small share of the device, its memory profile included; given back after, since a
    # later test in this process may start a stack that needs most of the device
    llm = LLM(SHIPPED_MODEL_DIR, device="cuda", gpu_memory_utilization=0.2)
    try:
        on_gpu = llm.generate(prompts, params)
    finally:
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    assert torch.cuda.memory_reserved() < 2**30

    assert [r.outputs[0].token_ids for r in on_gpu] == [r.outputs[0].token_ids for r in on_cpu]
    assert all(len(r.outputs[0].token_ids) > 0 for r in on_gpu)
