"""`outside_compiled_graphs`: under torch.compile the function runs eagerly between graphs, as
with torch.compiler.disable, but a worker that never compiles never imports torch._dynamo:
not when the kernels and model modules are imported, nor when a model is built on meta."""

from __future__ import annotations

import subprocess
import sys

import torch

from cleave.kernels.dispatch import outside_compiled_graphs


def test_a_call_runs_eagerly_between_compiled_graphs():
    eager_calls = []

    @outside_compiled_graphs
    def cache_work(x: torch.Tensor) -> torch.Tensor:
        eager_calls.append(x.shape)  # a side effect a traced graph would not repeat per call
        return x * 2

    def forward(x: torch.Tensor) -> torch.Tensor:
        return torch.sin(cache_work(torch.cos(x)))

    compiled = torch.compile(forward, backend="eager")
    x = torch.linspace(0, 1, 5)
    for _ in range(3):
        torch.testing.assert_close(compiled(x), torch.sin(torch.cos(x) * 2))
    assert len(eager_calls) == 3
    assert cache_work.__name__ == "cache_work"


def test_importing_the_model_and_building_it_on_meta_imports_no_dynamo():
    code = """
import sys
from cleave.model.config import ModelConfig
from cleave.model.loader import empty_model
import cleave.kernels.rotary_attention, cleave.engine.llm_engine
config = ModelConfig.from_dict({"architectures": ["LlamaForCausalLM"], "vocab_size": 64, "hidden_size": 32,
                                "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 4})
model = empty_model(config)
print(model.embed_tokens.weight.shape[0], "torch._dynamo" in sys.modules)
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert result.stdout.split() == ["64", "False"], result.stdout + result.stderr
