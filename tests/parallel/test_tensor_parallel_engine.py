"""`LLM.generate` end to end with tensor_parallel_size=2 on 2 gloo ranks (CPU): every rank runs
the whole engine (scheduler, chunked prefill, paged KV cache of its KV heads, sampler) in
step, and both ranks' tokens equal the TP=1 engine's."""

from __future__ import annotations

from pathlib import Path

import pytest

from cleave.engine.config import EngineConfig
from cleave.engine.llm import LLM
from cleave.engine.model_runner import ModelRunner
from cleave.generation.sampling_params import SamplingParams
from cleave.model.loader import load_model
from cleave.testing.tiny_models import write_tiny_checkpoint
from tests.parallel.rank_programs import engine_rank
from tests.parallel.ranks import run_ranks

WORLD_SIZE = 2
PROMPTS = [[i * 11 % 500 + 5 for i in range(length)] for length in (7, 30, 45, 18)]
# a 32-token step budget splits the longer prompts over several steps, beside decodes
ENGINE_KWARGS = dict(device="cpu", dtype="float32", seed=11, max_model_len=128, max_num_batched_tokens=32,
                     num_blocks=40, block_size=8)
GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
SAMPLED = SamplingParams(max_tokens=10, temperature=0.9, top_p=0.95, seed=5, ignore_eos=True, n=2)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tp-engine") / "llama", "llama", seed=31)


def test_generate_on_two_ranks_matches_one(checkpoint: Path) -> None:
    check_generate_on_two_ranks(checkpoint, ENGINE_KWARGS)


@pytest.mark.gpu
def test_generate_on_two_ranks_on_one_gpu_matches_one(checkpoint: Path) -> None:
    """Both ranks on the one GPU over gloo, eagerly (gloo collectives cannot be captured in a
    CUDA graph); the TP=1 engine runs its graphs and fused decode layouts."""
    check_generate_on_two_ranks(checkpoint, {**ENGINE_KWARGS, "device": "cuda", "enforce_eager": True})


def check_generate_on_two_ranks(checkpoint: Path, engine_kwargs: dict) -> None:
    params = [GREEDY, GREEDY, GREEDY, SAMPLED]
    reference_kwargs = {key: value for key, value in engine_kwargs.items() if key != "enforce_eager"}
    reference = LLM(checkpoint, **reference_kwargs).generate(PROMPTS, params)
    expected = [[sample.token_ids for sample in output.outputs] for output in reference]

    ranks = run_ranks(engine_rank, WORLD_SIZE, str(checkpoint), PROMPTS, params, engine_kwargs)

    for rank, result in enumerate(ranks):
        assert result["model_type"] == "TensorParallelCausalLM"
        # [L, 2, blocks, block_size, Hkv / 2, D]: each rank caches one of the two KV heads
        assert result["kv_cache_shape"] == (2, 2, 40, 8, 1, 16)
        assert result["tokens"][:3] == expected[:3], f"rank {rank}: greedy tokens"
    # seeded sampling draws the same tokens on every rank (the logits are gathered whole)
    assert ranks[0]["tokens"] == ranks[1]["tokens"]
    assert all(len(sample) == 10 for sample in ranks[0]["tokens"][3])


def test_runner_refuses_a_model_loaded_for_other_ranks(checkpoint: Path) -> None:
    # without a group the engine would run the whole model on every rank: refused, naming the fix
    config = EngineConfig(model=str(checkpoint), dtype="float32", device="cpu", tensor_parallel_size=2)
    with pytest.raises(ValueError, match=r"loaded for 1 rank\(s\).*tensor_parallel_group\(2\)"):
        ModelRunner(config, load_model(checkpoint))


def test_tensor_parallel_size_must_be_positive(checkpoint: Path) -> None:
    with pytest.raises(ValueError, match="tensor_parallel_size must be >= 1"):
        EngineConfig(model=str(checkpoint), tensor_parallel_size=0)
