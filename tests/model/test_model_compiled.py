"""The torch.compile path: reference ops, compiled forward, same logits."""

from __future__ import annotations

import pytest
import torch

from cleave.model.compiled import compile_model
from cleave.model.loader import load_model

from tests.model.test_llama_parity import TOLERANCE, prompt_ids, run_chunks


def test_compile_model_forces_reference_ops(tiny_checkpoints):
    model = load_model(tiny_checkpoints["llama"])
    compiled = compile_model(model)
    assert compiled is model
    impls = {module.impl for module in model.modules() if hasattr(module, "impl")}
    assert impls == {"torch"}
    assert {layer.self_attn.attention_impl for layer in model.layers} == {"auto"}
    assert hasattr(model.forward, "_torchdynamo_orig_callable")

@pytest.mark.slow
@torch.no_grad()
def test_compiled_logits_match_eager(tiny_checkpoints):
    eager = load_model(tiny_checkpoints["qwen3"])
    compiled = compile_model(load_model(tiny_checkpoints["qwen3"]), attention_impl="torch")
    input_ids = prompt_ids(eager.config.vocab_size)
    expected = run_chunks(eager, input_ids, [40, 24])
    assert (run_chunks(compiled, input_ids, [40, 24]) - expected).abs().max().item() <= TOLERANCE
