"""Start-up forwards that compile the kernel variants of prompt steps (`ModelRunner._warm_prefill_shapes`)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from cleave.engine.config import EngineConfig, SchedulerConfig
from cleave.engine.model_runner import PAGED_WARM_TOKENS, WARM_PREFILL_TOKENS, ModelRunner
from cleave.kv.groups import KVGroups
from cleave.model.llama import CausalLM, allocate_kv_cache
from tests.graphs.test_runner import tiny_config

BLOCK_SIZE = 16


def _runner(budget: int, num_blocks: int, paired: bool = False, max_model_len: int = 4096) -> ModelRunner:
    """A runner with a tiny model on the CPU and only what the warm-up reads; its rotary table
    ends at `max_model_len`, as an engine's max_model_len ends at the model's."""
    torch.manual_seed(0)
    config = dataclasses.replace(tiny_config(), num_hidden_layers=1, max_position_embeddings=max_model_len)
    runner = object.__new__(ModelRunner)
    scheduler = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=8, max_model_len=max_model_len)
    runner.config = EngineConfig(model="unused", device="cpu", scheduler=scheduler)
    runner.device = torch.device("cpu")
    runner.block_size = BLOCK_SIZE
    runner.kv_dtype = torch.float32
    runner.model_config = config
    runner.model = CausalLM(config).eval()
    runner.num_blocks = num_blocks
    runner.kv_groups = KVGroups((0,), (paired,), 64 if paired else None)
    runner.kv_cache = allocate_kv_cache(config, num_blocks, BLOCK_SIZE)
    return runner


def _recorded_forwards(runner: ModelRunner) -> list[tuple[int, int, bool, int]]:
    """(a prompt's tokens, cache pointer, has a window table, prompts) of every forward from
    now on."""
    seen: list[tuple[int, int, bool, int]] = []
    forward = runner.model.forward

    def recording(input_ids, positions, kv_cache, metadata):  # type: ignore[no-untyped-def]
        num_prompts = metadata.num_seqs
        assert input_ids.shape[0] == num_prompts * metadata.max_query_len  # prompts of one length
        tables = metadata.block_tables[:num_prompts].tolist()
        pages = [page for table in tables for page in table if page]
        if metadata.window is not None:
            pages += [page for table in metadata.window.block_tables[:num_prompts].tolist() for page in table if page]
        assert len(pages) == len(set(pages)) and 0 not in pages  # no prompt writes another's blocks
        assert positions.tolist() == list(range(metadata.max_query_len)) * num_prompts
        seen.append((metadata.max_query_len, kv_cache.data_ptr(), metadata.window is not None, num_prompts))
        if metadata.window is None:  # the tiny model has no sliding layer to read a window table
            return forward(input_ids, positions, kv_cache, metadata)
        return None

    runner.model.forward = recording
    return seen


@pytest.mark.parametrize(("budget", "num_blocks", "lengths", "pairs"),
                         [(4096, 4, [16, 32], [16]), (24, 4, [16, 24], []), (16, 4, [16], []),
                          (64, 5, [16, 32, 64], [16, 32]), (4096, 18, [16, 32], [16, 32, 64, 128])])
def test_short_prompts_the_budget_and_pairs_of_prompts_run_in_the_real_cache(budget, num_blocks, lengths, pairs):
    """One eager forward per warm length and the step budget, and one of two prompts per paged
    warm length, each that fits the step budget and the cache's free blocks (block 0 is the
    null block), in the real cache: its strides are what serving steps launch with (their
    32- or 64-bit typing included). A lone fresh prompt attends on dense SDPA on the GPU; two
    reach the paged prefill kernel, whose query block follows the longest."""
    assert WARM_PREFILL_TOKENS == (16, 32) and PAGED_WARM_TOKENS == (16, 32, 64, 128)
    runner = _runner(budget, num_blocks)
    seen = _recorded_forwards(runner)
    assert runner._warm_prefill_shapes() == len(lengths) + len(pairs)
    assert [(length, prompts) for length, _, _, prompts in seen] == [(n, 1) for n in lengths] + [(n, 2) for n in pairs]
    assert {pointer for _, pointer, _, _ in seen} == {runner.kv_cache.data_ptr()}
    assert not any(window for _, _, window, _ in seen)


def test_a_paired_cache_warms_with_a_window_table_on_blocks_of_its_own():
    """A paired cache's prompts carry window tables (as its serving steps do), on the blocks
    after the full tables', so each length needs twice its pages."""
    runner = _runner(64, 7, paired=True)  # 6 free blocks: 3 pages a table, up to 48 tokens
    seen = _recorded_forwards(runner)
    assert runner._warm_prefill_shapes() == 3
    assert [(length, window, prompts) for length, _, window, prompts in seen] == [
        (16, True, 1), (32, True, 1), (16, True, 2)]


def test_no_warm_prompt_is_longer_than_max_model_len():
    """A model whose positions end before the step budget (the shipped reasoner: 512 against
    2048) warms on prompts of at most max_model_len tokens: a longer one would read its rotary
    table past the end (an illegal address on the GPU)."""
    runner = _runner(4096, 18, max_model_len=24)
    seen = _recorded_forwards(runner)
    assert runner._warm_prefill_shapes() == 3
    assert [(length, prompts) for length, _, _, prompts in seen] == [(16, 1), (24, 1), (16, 2)]


def test_the_profile_step_fills_the_budget_with_prompts_no_longer_than_max_model_len():
    runner = _runner(100, 12, max_model_len=24)
    prompts = runner._budget_prompts(100)
    assert prompts == [24, 24, 24, 24, 4]

    with torch.inference_mode():
        hidden = runner._dummy_prefill(prompts, allocate_kv_cache(runner.model_config, 12, BLOCK_SIZE))

    assert hidden.shape == (100, runner.model_config.hidden_size) and torch.isfinite(hidden).all()
    assert runner._budget_prompts(24) == [24] and runner._budget_prompts(7) == [7]
    with pytest.raises(ValueError, match="longer than max_model_len"):
        runner._dummy_prefill([25], runner.kv_cache)
