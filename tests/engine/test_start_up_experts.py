"""Start-up runs of the expert kernels at every variant a step can meet
(`fused_moe.variant_token_counts`, `SparseMoeBlock.warm_variants`, `ModelRunner._warm_experts`)."""

from __future__ import annotations

import torch

from cleave.engine.config import EngineConfig, SchedulerConfig
from cleave.engine.model_runner import ModelRunner
from cleave.kernels.fused_moe import variant_token_counts
from cleave.model.config import ModelConfig
from cleave.model.llama import CausalLM
from cleave.model.moe import SparseMoeBlock

QWEN3_30B = dict(top_k=8, num_experts=128, inter=768, hidden=2048)  # Qwen3-30B-A3B's experts
TINY_MOE = dict(
    architecture="Qwen3MoeForCausalLM", vocab_size=64, hidden_size=32, intermediate_size=16, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=8, num_experts_per_tok=2,
    moe_intermediate_size=16, moe_layers=(0, 2),
)


def test_one_count_per_variant_of_the_built_in_rule():
    """Without a tuned table (CPU activations) the variants are the per-entry GEMVs' two down
    depths (1-2 and 3-4 tokens), then the grouped GEMMs, whose alignment runs ceil(8T / 64)
    programs (Qwen3-30B-A3B: 128 experts, 64 entries a program; its offsets kernel compiles for
    the next power of two: 2 from 9 tokens, 4 from 17, ..., 64 from 257) and whose rows per
    block grow with the entries per expert (16 up to 16 of them, i.e. 256 tokens; 32 up to 48,
    768 tokens; then 64): each count is the first token count of a new variant."""
    activations = torch.empty(1, dtype=torch.bfloat16)
    assert variant_token_counts(8192, **QWEN3_30B, activations=activations) == [1, 3, 5, 9, 17, 33, 65, 129, 257, 769]
    assert variant_token_counts(100, **QWEN3_30B, activations=activations) == [1, 3, 5, 9, 17, 33, 65]
    assert variant_token_counts(2, **QWEN3_30B, activations=activations) == [1]


def _recorded_token_counts(block: torch.nn.Module) -> list[int]:
    seen: list[int] = []
    block.register_forward_hook(lambda module, args, output: seen.append(args[0].shape[0]))
    return seen


def test_a_block_runs_once_at_each_variants_count():
    torch.manual_seed(0)
    config = ModelConfig(**TINY_MOE)
    block = SparseMoeBlock(config, impl="torch")
    for parameter in block.parameters():
        torch.nn.init.normal_(parameter, std=0.1)
    seen = _recorded_token_counts(block)
    expected = variant_token_counts(40, 2, 8, 16, 32, torch.empty(0))
    assert block.warm_variants(40) == len(expected) and seen == expected
    assert expected[:3] == [1, 3, 5]  # both down depths, then the grouped GEMMs


def test_the_runner_warms_one_block_of_each_expert_shape():
    """Layers 0 and 2 are MoE layers of one shape: one of them runs, at the step budget's counts."""
    torch.manual_seed(0)
    runner = object.__new__(ModelRunner)
    runner.config = EngineConfig(model="unused", device="cpu",
                                 scheduler=SchedulerConfig(max_num_batched_tokens=24, max_num_seqs=8))
    runner.model = CausalLM(ModelConfig(**TINY_MOE), impl="torch").eval()
    for parameter in runner.model.parameters():
        torch.nn.init.normal_(parameter, std=0.1)
    blocks = [module for module in runner.model.modules() if isinstance(module, SparseMoeBlock)]
    assert len(blocks) == 2
    seen = [_recorded_token_counts(block) for block in blocks]
    assert runner._warm_experts() == 1
    assert seen == [variant_token_counts(24, 2, 8, 16, 32, torch.empty(0)), []]
