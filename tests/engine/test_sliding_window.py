"""LLMEngine on a model whose every layer slides over one window (CPU, fp32): blocks behind
the window go back to the pool as generation moves, and greedy output still equals
transformers' (chunked prefill, several sequences, n = 2, a prefix hit, overlapped steps)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from cleave.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from cleave.engine.llm_engine import LLMEngine
from cleave.engine.request import OutputAccumulator
from cleave.generation.sampling_params import SamplingParams
from cleave.kv.groups import uniform_sliding_window
from cleave.model.config import ModelConfig
from cleave.testing.tiny_models import write_tiny_checkpoint
from tests.engine.hf_reference import hf_greedy_continuations

WINDOW = 12
BLOCK = 4
BOUND = -(-WINDOW // BLOCK) + 1  # blocks a decoding sequence holds at most
MAX_TOKENS = 40
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("sliding-window")
    return write_tiny_checkpoint(root / "mistral", "mistral", seed=11, sliding_window=WINDOW)


@pytest.fixture(scope="module")
def hf_greedy(checkpoint: Path) -> tuple[list[list[int]], list[list[int]]]:
    """Five prompts of 5..30 tokens and transformers' greedy continuations (eos disabled)."""
    rng = random.Random(4)
    return hf_greedy_continuations(
        checkpoint, lambda vocab: [[rng.randrange(vocab) for _ in range(n)] for n in (5, 13, 21, 30, 17)], MAX_TOKENS)


def held_blocks(engine: LLMEngine, seq_id: str) -> int:
    return sum(1 for block_id in engine.kv.block_table_view(seq_id) if block_id != 0)


@pytest.mark.parametrize("overlap", [False, True])
def test_greedy_matches_transformers_while_blocks_are_dropped(checkpoint, hf_greedy, overlap):
    prompts, expected = hf_greedy
    # 40 usable blocks; kept whole, the five sequences and two samples would need 6 * 18.
    engine = LLMEngine(EngineConfig(
        model=str(checkpoint), dtype="float32", device="cpu", overlap_steps=overlap,
        scheduler=SchedulerConfig(max_num_batched_tokens=16, max_model_len=128),
        cache=CacheConfig(block_size=BLOCK, num_blocks=41),
    ))
    assert engine.kv.sliding_window == WINDOW
    for index, prompt in enumerate(prompts[:4]):
        engine.add_request(f"r{index}", prompt, GREEDY)
    engine.add_request("pair", prompts[4], SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, n=2))
    accumulators: dict[str, OutputAccumulator] = {}
    num_checked = 0
    while engine.has_unfinished():
        for output in engine.step():
            accumulators.setdefault(output.request_id, OutputAccumulator(output.request_id)).add(output)
        for seq in engine.scheduler.running:
            if seq.num_output_tokens >= 3:  # a step that fed a sampled token was resolved
                assert held_blocks(engine, seq.seq_id) <= BOUND, seq
                num_checked += 1
    assert num_checked > 100
    assert engine.scheduler.stats.num_preemptions == 0

    for index in range(4):
        (sample,) = accumulators[f"r{index}"].result().outputs
        assert sample.token_ids == expected[index], f"prompt {index}"
    pair = accumulators["pair"].result().outputs
    assert [sample.token_ids for sample in pair] == [expected[4], expected[4]]
    assert engine.kv.num_free_blocks == engine.kv.num_usable_blocks

    # A prompt's blocks dropped while it generated stay in the prefix cache: the same prompt
    # next hits them (the run above churned through more blocks than the pool has, so the
    # cache is refilled first).
    again: dict[str, OutputAccumulator] = {}
    for request_id in ("first", "again"):
        hits = engine.scheduler.stats.num_prefix_cache_hit_tokens
        engine.add_request(request_id, prompts[3], GREEDY)
        while engine.has_unfinished():
            for output in engine.step():
                again.setdefault(output.request_id, OutputAccumulator(output.request_id)).add(output)
        assert again[request_id].result().outputs[0].token_ids == expected[3]
    assert engine.scheduler.stats.num_prefix_cache_hit_tokens - hits == 28  # every full prompt block
    assert engine.kv.num_free_blocks == engine.kv.num_usable_blocks


def _config(**kwargs) -> ModelConfig:
    shape = dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=1, head_dim=8)
    return ModelConfig(**shape, **kwargs)


def test_only_an_all_sliding_model_drops_blocks():
    assert uniform_sliding_window(_config(architecture="MistralForCausalLM", sliding_window=4096)) == 4096
    assert uniform_sliding_window(_config(architecture="LlamaForCausalLM")) is None
    gpt_oss = _config(architecture="GptOssForCausalLM", sliding_window=128,
                      layer_types=("sliding_attention", "full_attention"))
    assert uniform_sliding_window(gpt_oss) is None
