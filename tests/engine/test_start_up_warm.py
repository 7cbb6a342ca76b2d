"""Start-up forwards that compile the kernel variants of short prompts (`ModelRunner._warm_prefill_shapes`)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from cleave.engine.config import EngineConfig, SchedulerConfig
from cleave.engine.model_runner import WARM_PREFILL_TOKENS, ModelRunner
from cleave.model.llama import CausalLM, allocate_kv_cache
from tests.graphs.test_runner import tiny_config

BLOCK_SIZE = 16


def _runner(budget: int) -> ModelRunner:
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
    runner.kv_cache = allocate_kv_cache(config, 4, BLOCK_SIZE)
    return runner


@pytest.mark.parametrize(("budget", "lengths"), [(4096, [16, 32]), (24, [16]), (16, [])])
def test_short_prompts_run_in_scratch_caches_of_their_own(budget, lengths):
    """One eager forward per warm length under the step budget (the profile run covers the
    budget itself), each over a prompt of that many tokens in a cache of its own: the real
    cache is untouched."""
    assert WARM_PREFILL_TOKENS == (16, 32)
    runner = _runner(budget)
    real_cache = runner.kv_cache.clone()
    seen: list[tuple[int, int]] = []
    forward = runner.model.forward

    def recording(input_ids, positions, kv_cache, metadata):  # type: ignore[no-untyped-def]
        seen.append((input_ids.shape[0], kv_cache.data_ptr()))
        return forward(input_ids, positions, kv_cache, metadata)

    runner.model.forward = recording
    assert runner._warm_prefill_shapes() == len(lengths)
    assert [length for length, _ in seen] == lengths
    assert all(pointer != runner.kv_cache.data_ptr() for _, pointer in seen)
    assert torch.equal(runner.kv_cache, real_cache)
