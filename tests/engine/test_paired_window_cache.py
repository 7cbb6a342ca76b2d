"""LLMEngine on gpt-oss's alternating sliding-window / full-attention layers (CPU, fp32): the
cache pairs them (half the layer slots), the sliding layers' window tables give pages back as
generation moves, and greedy output still equals transformers' (chunked prefill, several
sequences, n = 2, a prefix hit, overlapped steps); a layer-by-layer KV listener hears each
slot once both its layers ran."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from cleave.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from cleave.engine.handoff import CachedPages
from cleave.engine.layer_progress import LayerProgress
from cleave.engine.llm_engine import LLMEngine
from cleave.engine.request import OutputAccumulator
from cleave.generation.sampling_params import SamplingParams
from cleave.kv.block_pool import NULL_BLOCK_ID
from cleave.testing.tiny_models import write_tiny_checkpoint
from tests.engine.hf_reference import hf_greedy_continuations
from tests.engine.window_workload import generate_checking_blocks, hit_prefix_twice, run_to_end

WINDOW = 6
BLOCK = 4
BOUND = -(-WINDOW // BLOCK) + 1  # window pages a decoding sequence holds at most
MAX_TOKENS = 40
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
LAYER_TYPES = ["sliding_attention", "full_attention", "full_attention", "sliding_attention"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("paired-window")
    return write_tiny_checkpoint(root / "gpt-oss", "gpt-oss", seed=13, num_hidden_layers=4,
                                 layer_types=LAYER_TYPES, sliding_window=WINDOW)


@pytest.fixture(scope="module")
def hf_greedy(checkpoint: Path) -> tuple[list[list[int]], list[list[int]]]:
    """Five prompts of 5..30 tokens and transformers' greedy continuations (eos disabled)."""
    rng = random.Random(5)
    return hf_greedy_continuations(
        checkpoint, lambda vocab: [[rng.randrange(vocab) for _ in range(n)] for n in (5, 13, 21, 30, 17)], MAX_TOKENS)


def _engine(checkpoint: Path, overlap: bool = False, num_blocks: int = 161) -> LLMEngine:
    return LLMEngine(EngineConfig(
        model=str(checkpoint), dtype="float32", device="cpu", overlap_steps=overlap,
        scheduler=SchedulerConfig(max_num_batched_tokens=16, max_model_len=96),
        cache=CacheConfig(block_size=BLOCK, num_blocks=num_blocks),
    ))


@pytest.mark.parametrize("overlap", [False, True])
def test_greedy_matches_transformers_while_window_pages_are_dropped(checkpoint, hf_greedy, overlap):
    prompts, expected = hf_greedy
    # 160 usable pages: kept whole in both tables, the six samples would need 2 * 6 * 18.
    engine = _engine(checkpoint, overlap)
    assert engine.kv_cache.shape[0] == 2 and engine.kv.window_group  # 4 layers, 2 slots

    def held(seq_id: str) -> int:
        assert NULL_BLOCK_ID not in engine.kv.block_table_view(seq_id)  # full layers keep every block
        return sum(1 for page in engine.kv.window_table_view(seq_id) if page != NULL_BLOCK_ID)

    generate_checking_blocks(engine, prompts, expected, MAX_TOKENS, held, BOUND)
    # the second run hits the first's full pages and its window pages in view
    assert hit_prefix_twice(engine, prompts[3], expected[3], MAX_TOKENS) >= 28  # every full prompt block


def test_start_up_prompts_in_the_real_paired_cache_leave_it_ready_for_serving(checkpoint, hf_greedy):
    """The start-up warm-up's prompts (`ModelRunner._warm_prefill_shapes`: the step budget of
    16 tokens here, with a window table) run in the real cache, then serving answers as
    transformers does and every block is free again."""
    prompts, expected = hf_greedy
    engine = _engine(checkpoint)
    assert engine.runner._warm_prefill_shapes() == 1
    free = engine.kv.num_free_blocks
    generate_checking_blocks(engine, prompts, expected, MAX_TOKENS,
                             lambda seq_id: sum(1 for page in engine.kv.window_table_view(seq_id)
                                                if page != NULL_BLOCK_ID), BOUND)
    assert engine.kv.num_free_blocks == free


def test_a_layer_listener_hears_each_slot_after_both_its_layers(checkpoint, hf_greedy):
    prompts, expected = hf_greedy
    engine = _engine(checkpoint)
    heard: list[tuple[int, int]] = []  # (slot, layers run by then)
    layers_run = []
    for layer in engine.model.layers:
        layer.register_forward_hook(lambda module, args, output: layers_run.append(1))

    def watch(output) -> LayerProgress:
        layers_run.clear()
        return LayerProgress(engine.kv_cache.shape[0], engine.runner.device,
                             lambda slot, ready: heard.append((slot, len(layers_run))))

    engine.watch_layers = watch
    engine.add_request("r", prompts[1], SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
    accumulators: dict[str, OutputAccumulator] = {}
    run_to_end(engine, accumulators)
    assert accumulators["r"].result().outputs[0].token_ids == expected[1][:1]
    # slot 0 pairs layers 0 and 1, slot 1 layers 2 and 3
    assert heard[:2] == [(0, 2), (1, 4)]


def test_unpaired_the_engine_keeps_a_slot_and_every_block_per_layer(checkpoint, hf_greedy):
    prompts, expected = hf_greedy
    engine = LLMEngine(EngineConfig(
        model=str(checkpoint), dtype="float32", device="cpu",
        scheduler=SchedulerConfig(max_num_batched_tokens=16, max_model_len=96),
        cache=CacheConfig(block_size=BLOCK, num_blocks=61, pair_window_layers=False),
    ))
    assert engine.kv_cache.shape[0] == 4 and not engine.kv.window_group and engine.kv.sliding_window is None
    engine.add_request("r", prompts[2], GREEDY)
    accumulators: dict[str, OutputAccumulator] = {}
    run_to_end(engine, accumulators)
    assert accumulators["r"].result().outputs[0].token_ids == expected[2]


def test_a_prompt_prefilled_elsewhere_arrives_in_both_tables(checkpoint, hf_greedy):
    """The hand-off moves a paired cache's pages (window table, then block table) but the
    window pages behind the window: a decode engine continues from them as transformers does."""
    prompts, expected = hf_greedy
    prompt = prompts[3]  # 30 tokens: 8 pages in each table
    prefill, decode = _engine(checkpoint), _engine(checkpoint)
    prefill.add_request("x", prompt, GREEDY, prefill_only=True)
    run_to_end(prefill, {})
    source = prefill.handoff.export("x")
    target = decode.handoff.reserve("x", len(prompt))
    assert len(source) == len(target) == decode.handoff.num_blocks_for(len(prompt)) == 16
    assert target == list(decode.kv.window_table_view("x/0")) + list(decode.kv.block_table("x/0"))
    # a query at 30 sees 25..30: the window pages of blocks 0..5 are neither held nor sent
    unseen = decode.handoff.num_unseen_pages(len(prompt))
    assert unseen == 6 and source[:unseen] == target[:unseen] == [NULL_BLOCK_ID] * unseen
    assert NULL_BLOCK_ID not in source[unseen:] + target[unseen:]
    decode.kv_cache[:, :, target[unseen:]] = prefill.kv_cache[:, :, source[unseen:]]
    prefill.handoff.release_export("x")
    assert prefill.kv.num_free_blocks == prefill.kv.num_usable_blocks
    decode.handoff.receive("x", prompt, expected[3][0], GREEDY)
    accumulators: dict[str, OutputAccumulator] = {}
    run_to_end(decode, accumulators)
    assert accumulators["x"].result().outputs[0].token_ids == expected[3]
    assert decode.kv.num_free_blocks == decode.kv.num_usable_blocks


def test_a_prefix_copied_through_the_kvstore_pages_continues_as_transformers(checkpoint, hf_greedy):
    """The kvstore's path for a paired cache: the source's prefix cache still holds the window
    pages in view after a prompt's first 4 blocks (its own table dropped them as the
    prefill moved on); `hold_cached` holds them with the full pages, they are copied, and a
    second engine's `hold_prefix` takes them: its prompt computes only the rest, and greedy
    output equals transformers'."""
    prompts, expected = hf_greedy
    prompt = prompts[3]  # 30 tokens, prefilled in chunks of 16
    source, target = _engine(checkpoint), _engine(checkpoint)
    source.add_request("x", prompt, GREEDY, prefill_only=True)
    run_to_end(source, {})
    source.handoff.release_export("x")
    prefix = prompt[:16]  # a query at 16 sees positions 11..16: window pages of blocks 2 and 3
    pages = source.handoff.hold_cached("x", prefix)
    assert (pages.num_blocks, pages.first_window_page, len(pages.window_page_ids)) == (4, 2, 2)
    assert NULL_BLOCK_ID not in pages.block_ids + pages.window_page_ids
    assert source.kv.num_free_blocks == source.kv.num_usable_blocks - 6  # held until released
    hold = target.handoff.hold_prefix("y", prefix)
    assert hold is not None and (hold.num_cached_blocks, hold.first_new_window_page) == (0, 2)
    assert (len(hold.new_block_ids), len(hold.new_window_page_ids)) == (4, 2)
    assert target.kv.num_free_blocks == target.kv.num_usable_blocks - 6  # the unseen new window pages went back
    target.kv_cache[:, :, hold.new_block_ids] = source.kv_cache[:, :, pages.block_ids]
    target.kv_cache[:, :, hold.new_window_page_ids] = source.kv_cache[:, :, pages.window_page_ids]
    target.handoff.publish_hold("y", prefix)
    source.handoff.release_cached("x")
    assert source.kv.num_free_blocks == source.kv.num_usable_blocks
    target.add_request("y", prompt, GREEDY)
    target.handoff.release_hold("y")  # the request's prefix hit holds the pages from here on
    accumulators: dict[str, OutputAccumulator] = {}
    run_to_end(target, accumulators)
    assert accumulators["y"].result().outputs[0].token_ids == expected[3]
    assert target.scheduler.stats.num_prefix_cache_hit_tokens == 16
    assert target.kv.num_free_blocks == target.kv.num_usable_blocks
    assert source.handoff.hold_cached("z", prompt[:4]).num_blocks == 1  # one block: its window page is in view
    source.handoff.release_cached("z")
    assert target.handoff.hold_cached("z", [7] * 8) == CachedPages([])  # nothing cached: nothing held
    assert target.kv.num_free_blocks == target.kv.num_usable_blocks


def test_a_prompt_prefilled_in_chunks_drops_window_pages_as_it_goes(checkpoint, hf_greedy):
    prompts, expected = hf_greedy
    engine = _engine(checkpoint)  # 16-token chunks
    engine.add_request("r", prompts[3], GREEDY)  # 30 tokens: two chunks
    engine.step()
    # after 16 tokens the next query (16) sees 11..16: the window pages of blocks 0 and 1 are gone
    assert list(engine.kv.window_table_view("r/0"))[:2] == [NULL_BLOCK_ID] * 2
    assert NULL_BLOCK_ID not in engine.kv.block_table_view("r/0")
    accumulators: dict[str, OutputAccumulator] = {}
    run_to_end(engine, accumulators)
    assert accumulators["r"].result().outputs[0].token_ids == expected[3]


@pytest.mark.parametrize("overlap", [False, True])
def test_preempted_sequences_recompute_to_the_same_tokens(checkpoint, hf_greedy, overlap):
    """A pool too small for every sequence at once: the scheduler preempts, a recompute finds
    its own pages (full and window) in the prefix cache or computes them again, and the
    outputs still equal transformers'."""
    prompts, expected = hf_greedy
    engine = _engine(checkpoint, overlap, num_blocks=49)  # 48 pages: the five prompts grow past it together
    for index, prompt in enumerate(prompts):
        engine.add_request(f"r{index}", prompt, GREEDY)
    accumulators: dict[str, OutputAccumulator] = {}
    run_to_end(engine, accumulators)
    assert engine.scheduler.stats.num_preemptions > 0
    for index in range(5):
        assert accumulators[f"r{index}"].result().outputs[0].token_ids == expected[index], f"prompt {index}"
    assert engine.kv.num_free_blocks == engine.kv.num_usable_blocks


@pytest.mark.gpu
@pytest.mark.parametrize("eager", [False, True], ids=["graphs", "eager"])
def test_window_tables_on_cuda_match_transformers(checkpoint, hf_greedy, eager):
    """The same workload on the GPU in fp32: decode steps replay CUDA graphs whose static
    buffers carry the window tables (null pages behind the window), or run eagerly."""
    prompts, expected = hf_greedy
    engine = LLMEngine(EngineConfig(
        model=str(checkpoint), dtype="float32", device="cuda", enforce_eager=eager,
        scheduler=SchedulerConfig(max_num_batched_tokens=16, max_model_len=96),
        cache=CacheConfig(block_size=BLOCK, num_blocks=161),
    ))
    assert (engine.runner.graph_runner is None) is eager and engine.kv.window_group

    def held(seq_id: str) -> int:
        return sum(1 for page in engine.kv.window_table_view(seq_id) if page != NULL_BLOCK_ID)

    generate_checking_blocks(engine, prompts, expected, MAX_TOKENS, held, BOUND)
