"""Tensor parallelism over 2 gloo ranks on CPU: each rank loads its shard of a tiny checkpoint
and runs a batch (one prefill, then decode steps) through a KV cache in the engine's paged
layout; greedy tokens, logits (fp32) and each rank's KV heads must equal the TP=1 model's."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from cleave.model.config import ModelConfig
from cleave.model.llama import CausalLM
from cleave.model.loader import load_model
from cleave.parallel.sharding import TensorParallelLayout
from cleave.testing.tiny_models import write_tiny_checkpoint
from tests.parallel.paged_batch import greedy_paged
from tests.parallel.rank_programs import model_rank
from tests.parallel.ranks import run_ranks

WORLD_SIZE = 2
MAX_NEW_TOKENS = 6
TOLERANCE = 1e-4  # fp32; the ranks sum partial products in another order than one GEMM
GPU_TOLERANCE = 1e-3
# three sequences; the longest crosses two block boundaries
PROMPTS = [[5, 17, 260, 33, 99], [i * 7 % 500 + 3 for i in range(23)], [i * 13 % 511 for i in range(40)]]

# name -> (tiny architecture, config overrides, what the case covers)
CASES = {
    "llama": ("llama", {}, "2 KV heads split over 2 ranks, llama3 rope, untied head"),
    "llama-one-kv-head": ("llama", {"num_key_value_heads": 1}, "1 KV head replicated on both ranks"),
    "qwen2": ("qwen2", {}, "q/k/v biases, tied embeddings"),
    "qwen3-odd-vocab": ("qwen3", {"vocab_size": 515}, "q/k norms, a vocabulary the ranks do not divide"),
    "mistral-window": ("mistral", {"sliding_window": 12}, "every layer slides over 12 keys (prompts up to 40)"),
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tp-tiny")
    paths = {}
    for index, (name, (arch, overrides, _)) in enumerate(CASES.items()):
        # the replicated-KV case is also a multi-file checkpoint (an index and several shards)
        shard_size = {"max_shard_size": "60KB"} if name == "llama-one-kv-head" else {}
        paths[name] = write_tiny_checkpoint(root / name, arch, seed=20 + index, **shard_size, **overrides)
    return paths


@pytest.mark.parametrize("name", list(CASES))
def test_two_ranks_match_one(name: str, checkpoints: dict[str, Path]) -> None:
    check_two_ranks_match_one(checkpoints[name], "cpu", TOLERANCE)


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(CASES))
def test_two_ranks_on_one_gpu_match_one(name: str, checkpoints: dict[str, Path]) -> None:
    """The same on CUDA, on the Triton kernels with a rank's head counts; both ranks share the
    one GPU over gloo (NCCL refuses two ranks on one device). The TP=1 reference decodes on
    the fused GEMV layout, the ranks on the model's own layers, hence the wider tolerance."""
    check_two_ranks_match_one(checkpoints[name], "cuda", GPU_TOLERANCE)


def check_two_ranks_match_one(path: Path, device: str, tolerance: float) -> None:
    reference_model = load_model(path, device=device)
    # TP=1 is the plain model and runs without any process group (a collective would raise)
    assert type(reference_model) is CausalLM and not dist.is_initialized()
    reference = greedy_paged(reference_model, PROMPTS, MAX_NEW_TOKENS, device)
    config = ModelConfig.from_pretrained(path)

    ranks = run_ranks(model_rank, WORLD_SIZE, str(path), PROMPTS, MAX_NEW_TOKENS, device)

    for rank, result in enumerate(ranks):
        assert result["tokens"] == reference["tokens"], f"rank {rank}"
        assert (result["prompt_logits"] - reference["prompt_logits"]).abs().max().item() <= tolerance
        for step, logits in enumerate(result["decode_logits"]):
            assert (logits - reference["decode_logits"][step]).abs().max().item() <= tolerance, f"step {step}"
        # the rank's cache holds exactly its KV heads of the whole model's cache
        layout = TensorParallelLayout(config, rank, WORLD_SIZE)
        assert result["first_kv_head"] == layout.first_kv_head
        heads = slice(layout.first_kv_head, layout.first_kv_head + layout.num_kv_heads)
        expected_kv = reference["kv_cache"][:, :, :, :, heads]
        assert result["kv_cache"].shape == expected_kv.shape
        assert (result["kv_cache"] - expected_kv).abs().max().item() <= tolerance
        # loading reads slices only; then per step one all-reduce for the embedding, one per
        # attention block and one per MLP block, and one all-gather of the logits
        assert result["collectives_after_load"] == {"all_reduce": 0, "all_gather": 0, "all_to_all_single": 0}
        layers = result["num_layers"]
        assert result["collectives"] == {
            "all_reduce": MAX_NEW_TOKENS * (1 + 2 * layers), "all_gather": MAX_NEW_TOKENS, "all_to_all_single": 0
        }
        # every rank holds 1/2 of each split weight (the embedding rounded up, zero-padded)
        shapes = result["parameter_shapes"]
        assert shapes["layers.0.self_attn.qkv_proj.weight"] == (
            (layout.num_heads + 2 * layout.num_kv_heads) * config.head_dim, config.hidden_size
        )
        assert shapes["layers.0.mlp.down_proj.weight"] == (config.hidden_size, config.intermediate_size // WORLD_SIZE)
        assert shapes["embed_tokens.weight"] == (-(-config.vocab_size // WORLD_SIZE), config.hidden_size)
    if config.num_key_value_heads < WORLD_SIZE:  # both ranks hold (and wrote) the same single KV head
        assert torch.equal(ranks[0]["kv_cache"], ranks[1]["kv_cache"])
