"""The engine with an fp8 KV cache (`CacheConfig.kv_cache_dtype="fp8"`) on a tiny random
checkpoint (CPU, bf16 weights): the cache is float8 e4m3 at half the bytes per block, its
logits stay near those over the bf16 cache, and the engine generates through it.

The memory budget's side (twice the blocks in one share) is in test_memory_budget.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from cleave.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from cleave.engine.llm import build_engine_config
from cleave.engine.llm_engine import LLMEngine
from cleave.engine.request import OutputAccumulator
from cleave.generation.sampling_params import SamplingParams
from cleave.kv.metadata import AttentionMetadata
from cleave.testing.tiny_models import write_tiny_checkpoint

PROMPTS = [[5, 17, 42, 8, 99, 3, 61, 27, 14, 70, 33, 2, 88, 41, 9, 56, 23, 71, 12, 4, 64],  # over a block
           [30, 11, 7, 93, 50]]
BLOCK_SIZE = 16


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("kv-fp8") / "llama", "llama", dtype=torch.bfloat16, seed=3)


def make_engine(path: Path, kv_cache_dtype: str) -> LLMEngine:
    return LLMEngine(EngineConfig(
        model=str(path), dtype="bfloat16", device="cpu", scheduler=SchedulerConfig(max_model_len=128),
        cache=CacheConfig(block_size=BLOCK_SIZE, num_blocks=16, kv_cache_dtype=kv_cache_dtype),
    ))


@torch.inference_mode()
def prefill_logits(engine: LLMEngine, prompt: list[int]) -> torch.Tensor:
    """[T, V] fp32 logits of a prompt's prefill into blocks 1, 2 of the engine's cache: every
    row's attention reads the K/V the step has just written there."""
    metadata = AttentionMetadata.build([len(prompt)], [len(prompt)], [[1, 2]], BLOCK_SIZE)
    hidden = engine.model(torch.tensor(prompt), torch.arange(len(prompt)), engine.kv_cache, metadata)
    return engine.model.compute_logits(hidden)


def test_an_fp8_cache_holds_half_the_bytes_and_its_first_step_logits_stay_near_bf16s(checkpoint):
    bf16, fp8 = make_engine(checkpoint, "auto"), make_engine(checkpoint, "fp8")
    assert (bf16.kv_cache.dtype, fp8.kv_cache.dtype) == (torch.bfloat16, torch.float8_e4m3fn)
    assert fp8.kv_cache.shape == bf16.kv_cache.shape
    assert 2 * fp8.runner._bytes_per_block() == bf16.runner._bytes_per_block()
    assert fp8.kv.namespace != bf16.kv.namespace  # their blocks never share prefix hashes

    expected, logits = prefill_logits(bf16, PROMPTS[0]), prefill_logits(fp8, PROMPTS[0])

    # e4m3 keeps 3 mantissa bits: each cached K and V value moves by up to 1/16 of itself
    # (bf16: 1/256), and through two layers' attention the tiny model's logits (std ~0.8, a
    # range of ~6) moved by 0.02 on average and 0.14 at most when this was written. 0.25
    # leaves room for that and still fails a cache read wrongly (bytes taken for values, a
    # missed upcast, K and V swapped), which moves logits by their whole spread.
    torch.testing.assert_close(logits, expected, atol=0.25, rtol=0)
    assert (logits - expected).abs().mean() < 0.05


def test_an_engine_generates_over_an_fp8_cache_with_shared_prompt_blocks(checkpoint):
    engine = make_engine(checkpoint, "fp8")
    # two samples of one prompt share its blocks: the partial last one is copied on write
    params = SamplingParams(max_tokens=6, temperature=1.0, seed=7, n=2, ignore_eos=True)
    for index, prompt in enumerate(PROMPTS):
        engine.add_request(f"r{index}", prompt, params)
    outputs: dict[str, OutputAccumulator] = {}
    while engine.has_unfinished():
        for output in engine.step():
            outputs.setdefault(output.request_id, OutputAccumulator(output.request_id)).add(output)

    for accumulator in outputs.values():
        samples = accumulator.result().outputs
        assert [len(sample.token_ids) for sample in samples] == [6, 6]
    assert engine.kv_cache.dtype == torch.float8_e4m3fn
    assert not torch.isnan(engine.kv_cache.float()).any()


def test_an_unknown_kv_cache_dtype_is_refused_naming_the_field(checkpoint):
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        CacheConfig(kv_cache_dtype="int8")
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, fp8"):
        build_engine_config(checkpoint, device="cpu", kv_cache_dtype="fp8_e5m2")
    assert build_engine_config(checkpoint, device="cpu", kv_cache_dtype="fp8").cache.kv_cache_dtype == "fp8"
