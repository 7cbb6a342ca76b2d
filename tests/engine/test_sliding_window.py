"""LLMEngine on a model whose every layer slides over one window (CPU, fp32): blocks behind
the window go back to the pool as generation moves, and greedy output still equals
transformers' (chunked prefill, several sequences, n = 2, a prefix hit, overlapped steps)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from cleave.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from cleave.engine.llm_engine import LLMEngine
from cleave.generation.sampling_params import SamplingParams
from cleave.kv.groups import uniform_sliding_window
from cleave.model.config import ModelConfig
from cleave.testing.tiny_models import write_tiny_checkpoint
from tests.engine.hf_reference import hf_greedy_continuations
from tests.engine.window_workload import generate_checking_blocks, hit_prefix_twice, run_to_end

WINDOW = 12
BLOCK = 4
BOUND = -(-WINDOW // BLOCK) + 1  # blocks a decoding sequence holds at most
MAX_TOKENS = 40


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
    generate_checking_blocks(engine, prompts, expected, MAX_TOKENS, lambda seq_id: held_blocks(engine, seq_id), BOUND)
    # A prompt's blocks dropped while it generated stay in the prefix cache: the same prompt
    # next hits them (the run above churned through more blocks than the pool has, so the
    # first run refills the cache).
    assert hit_prefix_twice(engine, prompts[3], expected[3], MAX_TOKENS) == 28  # every full prompt block


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


def test_an_exported_prompt_keeps_every_block(checkpoint, hf_greedy):
    """A hand-off sends every block of a one-table cache (only a paired cache's window pages
    behind the window are skipped), so the export drops none."""
    prompts, _ = hf_greedy
    engine = LLMEngine(EngineConfig(
        model=str(checkpoint), dtype="float32", device="cpu",
        scheduler=SchedulerConfig(max_num_batched_tokens=16, max_model_len=128),
        cache=CacheConfig(block_size=BLOCK, num_blocks=41),
    ))
    engine.add_request("x", prompts[3], SamplingParams(max_tokens=1, temperature=0.0), prefill_only=True)
    run_to_end(engine, {})
    pages = engine.handoff.export("x")  # 30 tokens, a window of 12: a query at 30 sees 19..30
    assert engine.handoff.num_unseen_pages(30) == 0 and len(pages) == 8 and 0 not in pages
    engine.handoff.release_export("x")
    assert engine.kv.num_free_blocks == engine.kv.num_usable_blocks
