"""Start-up forwards that compile the kernel variants of prompt steps (`ModelRunner._warm_prefill_shapes`)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from cleave.engine.config import EngineConfig, SchedulerConfig
from cleave.engine.model_runner import WARM_PREFILL_TOKENS, ModelRunner
from cleave.kv.groups import KVGroups
from cleave.model.llama import CausalLM, allocate_kv_cache
from tests.graphs.test_runner import tiny_config

BLOCK_SIZE = 16


def _runner(budget: int, num_blocks: int, paired: bool = False) -> ModelRunner:
    """A runner with a tiny model on the CPU and only what the warm-up reads."""
    torch.manual_seed(0)
    config = dataclasses.replace(tiny_config(), num_hidden_layers=1)
    runner = object.__new__(ModelRunner)
    runner.config = EngineConfig(model="unused", device="cpu",
                                 scheduler=SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=8))
    runner.device = torch.device("cpu")
    runner.block_size = BLOCK_SIZE
    runner.kv_dtype = torch.float32
    runner.model_config = config
    runner.model = CausalLM(config).eval()
    runner.num_blocks = num_blocks
    runner.kv_groups = KVGroups((0,), (paired,), 64 if paired else None)
    runner.kv_cache = allocate_kv_cache(config, num_blocks, BLOCK_SIZE)
    return runner


def _recorded_forwards(runner: ModelRunner) -> list[tuple[int, int, bool]]:
    """(prompt tokens, cache pointer, has a window table) of every forward from now on."""
    seen: list[tuple[int, int, bool]] = []
    forward = runner.model.forward

    def recording(input_ids, positions, kv_cache, metadata):  # type: ignore[no-untyped-def]
        seen.append((input_ids.shape[0], kv_cache.data_ptr(), metadata.window is not None))
        if metadata.window is None:  # the tiny model has no sliding layer to read a window table
            return forward(input_ids, positions, kv_cache, metadata)
        return None

    runner.model.forward = recording
    return seen


@pytest.mark.parametrize(("budget", "num_blocks", "lengths"),
                         [(4096, 4, [16, 32]), (24, 4, [16, 24]), (16, 4, [16]), (64, 5, [16, 32, 64])])
def test_short_prompts_and_the_budget_run_in_the_real_cache(budget, num_blocks, lengths):
    """One eager forward per warm length and the step budget, each that fits the cache's free
    blocks (block 0 is the null block), in the real cache: its strides are what serving
    steps launch with (their 32- or 64-bit typing included)."""
    assert WARM_PREFILL_TOKENS == (16, 32)
    runner = _runner(budget, num_blocks)
    seen = _recorded_forwards(runner)
    assert runner._warm_prefill_shapes() == len(lengths)
    assert [length for length, _, _ in seen] == lengths
    assert {pointer for _, pointer, _ in seen} == {runner.kv_cache.data_ptr()}
    assert not any(window for _, _, window in seen)


def test_a_paired_cache_warms_with_a_window_table_on_blocks_of_its_own():
    """A paired cache's prompts carry a window table (as its serving steps do), on the blocks
    after the full table's, so each length needs twice its pages."""
    runner = _runner(64, 7, paired=True)  # 6 free blocks: 3 pages a table, up to 48 tokens
    seen = _recorded_forwards(runner)
    assert runner._warm_prefill_shapes() == 2
    assert [(length, window) for length, _, window in seen] == [(16, True), (32, True)]
