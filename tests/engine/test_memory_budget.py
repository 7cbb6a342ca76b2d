"""The KV budget of a worker that may share its GPU: blocks from its share of the device's
total memory, refusal when that share is not free (CPU only: torch.cuda readings mocked)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from cleave.engine.config import CacheConfig, EngineConfig
from cleave.engine.memory_budget import (
    CUDA_HEADROOM_BYTES,
    DeviceMemory,
    InsufficientDeviceMemory,
    kv_blocks_for_share,
)
from cleave.engine.model_runner import ModelRunner
from cleave.errors import ResourceExhausted
from cleave.kernels.kv_cache_dtype import resolve_kv_cache_dtype
from cleave.kv.groups import KVGroups

GIB = 2**30
TOTAL = 80 * GIB
WEIGHTS = 2 * GIB
PEAK = 1 * GIB
VOCAB = 128256
BLOCK = 2 * 2**20  # 2 MiB per block


def test_blocks_fill_the_share_after_weights_activations_and_headroom():
    memory = DeviceMemory("cuda:0", free_bytes=TOTAL - WEIGHTS, total_bytes=TOTAL, held_bytes=WEIGHTS)
    blocks = kv_blocks_for_share(memory, 0.6, PEAK, BLOCK)
    kv_bytes = 0.6 * TOTAL - WEIGHTS - PEAK - CUDA_HEADROOM_BYTES  # 44.5 GiB
    assert blocks == int(kv_bytes // BLOCK) + 1 == 22785  # + the null block


def test_the_other_workers_memory_does_not_shrink_this_ones_cache():
    # prefill (0.3) and decode (0.6) start together on one 80 GiB GPU; decode reads the
    # device before and after prefill took its whole share: same cache either way
    before = DeviceMemory("cuda:0", TOTAL - 2 * WEIGHTS, TOTAL, WEIGHTS)
    after = DeviceMemory("cuda:0", TOTAL - WEIGHTS - int(0.3 * TOTAL), TOTAL, WEIGHTS)
    assert kv_blocks_for_share(before, 0.6, PEAK, BLOCK) == kv_blocks_for_share(after, 0.6, PEAK, BLOCK)
    prefill_blocks = kv_blocks_for_share(after, 0.3, PEAK, BLOCK)
    # the old rule (0.9 each, minus all used memory) left the second worker nothing; now the
    # two shares add up to at most 0.9 of the device, caches and weights included
    assert (prefill_blocks + 22785 - 2) * BLOCK + 2 * (WEIGHTS + PEAK + CUDA_HEADROOM_BYTES) <= 0.9 * TOTAL


def test_refuses_when_another_process_holds_part_of_the_share():
    # someone else holds 50 GiB: 28 GiB free, but the 0.6 share needs 46 GiB more
    memory = DeviceMemory("cuda:1", free_bytes=28 * GIB, total_bytes=TOTAL, held_bytes=WEIGHTS)
    with pytest.raises(InsufficientDeviceMemory) as caught:
        kv_blocks_for_share(memory, 0.6, PEAK, BLOCK)
    message = str(caught.value)
    assert "cuda:1 has 28.00 GiB free of 80.00 GiB" in message
    assert "--gpu-memory-utilization 0.6: 48.00 GiB" in message and "46.00 GiB more" in message
    for fix in ("Lower --gpu-memory-utilization", "stop the other process", "--num-kv-blocks"):
        assert fix in message
    assert isinstance(caught.value, ResourceExhausted)


def test_refuses_when_the_share_cannot_hold_weights_and_activations():
    memory = DeviceMemory("cuda:0", free_bytes=TOTAL - WEIGHTS, total_bytes=TOTAL, held_bytes=WEIGHTS)
    with pytest.raises(InsufficientDeviceMemory, match="leaves no room for the KV cache") as caught:
        kv_blocks_for_share(memory, 0.04, PEAK, BLOCK)  # 3.2 GiB < 2 + 1 + 0.5 GiB
    assert "Raise --gpu-memory-utilization" in str(caught.value)
    assert "--gpu-memory-split" in str(caught.value)


def test_exactly_enough_free_memory_starts():
    share = int(0.5 * TOTAL)
    memory = DeviceMemory("cuda:0", free_bytes=share - WEIGHTS, total_bytes=TOTAL, held_bytes=WEIGHTS)
    expected = int((share - WEIGHTS - PEAK - CUDA_HEADROOM_BYTES) // BLOCK) + 1
    assert kv_blocks_for_share(memory, 0.5, PEAK, BLOCK) == expected
    short = DeviceMemory("cuda:0", free_bytes=share - WEIGHTS - 1, total_bytes=TOTAL, held_bytes=WEIGHTS)
    with pytest.raises(InsufficientDeviceMemory):
        kv_blocks_for_share(short, 0.5, PEAK, BLOCK)


def _runner(cache: CacheConfig, device: str = "cuda:0") -> ModelRunner:
    # the memory-budget path only: no model, no allocation
    runner = object.__new__(ModelRunner)
    runner.config = EngineConfig(model="unused", device=device, cache=cache)
    runner.device = torch.device(device)
    runner.block_size = cache.block_size
    runner.kv_dtype = resolve_kv_cache_dtype(cache.kv_cache_dtype, torch.bfloat16)  # a bf16 model's
    runner.model_config = SimpleNamespace(num_hidden_layers=4, num_key_value_heads=2, head_dim=64)
    runner.kv_groups = KVGroups(tuple(range(4)), (False,) * 4, None)  # a slot per layer
    runner.vocab_size = VOCAB
    return runner


def test_runner_sizes_the_cache_from_its_share_of_total_memory(monkeypatch):
    runner = _runner(CacheConfig(block_size=16, gpu_memory_utilization=0.3))
    monkeypatch.setattr(ModelRunner, "_profile_peak_bytes", lambda self: PEAK)
    # another worker already holds 40 GiB of the device
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (TOTAL - 40 * GIB - WEIGHTS, TOTAL))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: WEIGHTS)
    bytes_per_block = 4 * 2 * 16 * 2 * 64 * 2  # layers * K,V * tokens * heads * dim * bf16
    assert runner._bytes_per_block() == bytes_per_block
    # the penalty tables' full size is set aside: a count and a flag per token for every
    # sequence a step may sample, kept and gathered (cleave.engine.penalty_counts)
    penalty_tables = (2 * runner.config.scheduler.max_num_seqs + 1) * VOCAB * 5
    expected = int((0.3 * TOTAL - WEIGHTS - PEAK - penalty_tables - CUDA_HEADROOM_BYTES) // bytes_per_block) + 1
    assert runner._init_num_blocks() == expected


def test_a_paired_cache_block_holds_half_the_layers():
    runner = _runner(CacheConfig(block_size=16))
    runner.kv_groups = KVGroups((0, 0, 1, 1), (True, False, True, False), 128)
    assert runner._bytes_per_block() == 2 * 2 * 16 * 2 * 64 * 2  # slots * K,V * tokens * heads * dim * bf16


def test_an_fp8_cache_fits_twice_the_blocks_of_a_bf16_model_in_the_same_share(monkeypatch):
    monkeypatch.setattr(ModelRunner, "_profile_peak_bytes", lambda self: PEAK)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (TOTAL - WEIGHTS, TOTAL))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: WEIGHTS)
    auto = _runner(CacheConfig(block_size=16, gpu_memory_utilization=0.3))
    fp8 = _runner(CacheConfig(block_size=16, gpu_memory_utilization=0.3, kv_cache_dtype="fp8"))
    assert fp8.kv_dtype == torch.float8_e4m3fn
    assert 2 * fp8._bytes_per_block() == auto._bytes_per_block() == 4 * 2 * 16 * 2 * 64 * 2
    auto_blocks, fp8_blocks = auto._init_num_blocks(), fp8._init_num_blocks()
    # the null block 0 is counted once in each, and the KV bytes need not divide evenly
    assert 2 * (auto_blocks - 1) <= fp8_blocks - 1 <= 2 * (auto_blocks - 1) + 1


def test_runner_refusal_names_the_device(monkeypatch):
    runner = _runner(CacheConfig(gpu_memory_utilization=0.9), device="cuda:2")
    monkeypatch.setattr(ModelRunner, "_profile_peak_bytes", lambda self: PEAK)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (30 * GIB, TOTAL))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: WEIGHTS)
    with pytest.raises(InsufficientDeviceMemory, match=r"cuda:2 has 30.00 GiB free of 80.00 GiB"):
        runner._init_num_blocks()


def test_explicit_blocks_are_what_was_asked(monkeypatch):
    runner = _runner(CacheConfig(num_blocks=300, gpu_memory_utilization=0.3))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: pytest.fail("no reading with explicit blocks"))
    assert runner._init_num_blocks() == 300
