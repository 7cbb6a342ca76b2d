"""Shared by the benches that compare decode-step variants in one process.

Each variant is captured into its own `CUDAGraphRunner` over one model and one KV cache, and
the variants' back-to-back steps are timed in turns, so drift of the machine over the run
hits all of them alike (`bench/decode_ab.py`, `bench/attention_in_step.py`).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from decode import (
    RESERVED_BYTES,
    Case,
    build_model,
    kv_bytes_per_token,
    llama_3_2_1b_config,
    pipelined_ms,
    weight_bytes_read,
)

from cleave.graphs.runner import CUDAGraphRunner, GraphRunnerConfig
from cleave.kv.metadata import AttentionMetadata
from cleave.model.config import ModelConfig
from cleave.model.llama import CausalLM, allocate_kv_cache

StepFn = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor]


@dataclass
class StepBench:
    """The Llama-3.2-1B-shaped model (random bf16 weights) and a KV cache for `cases`."""

    config: ModelConfig
    model: CausalLM
    kv_cache: torch.Tensor
    num_blocks: int
    block_size: int
    max_model_len: int
    weight_bytes: int

    def step(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        return self.model.compute_logits(self.model(input_ids, positions, self.kv_cache, metadata))

    def gb_read(self, case: Case) -> float:
        """Weights + KV bytes one step reads, in GB."""
        return (self.weight_bytes + case.batch * case.context * kv_bytes_per_token(self.config)) / 1e9

    def runner(self, step: StepFn, max_batch_size: int) -> CUDAGraphRunner:
        """A captured runner of `step` for batches up to `max_batch_size`."""
        runner = CUDAGraphRunner(
            step,
            GraphRunnerConfig(max_batch_size, -(-self.max_model_len // self.block_size), self.block_size),
            torch.device("cuda"),
        )
        runner.capture()
        return runner


def build_step_bench(cases: Sequence[Case], block_size: int, max_model_len: int) -> StepBench:
    device = torch.device("cuda")
    config = llama_3_2_1b_config()
    model = build_model(config, device)
    num_blocks = max(case.kv_blocks(block_size) for case in cases) + 1
    if num_blocks * block_size * kv_bytes_per_token(config) > torch.cuda.mem_get_info()[0] - RESERVED_BYTES:
        raise SystemExit("the KV cache for these cases does not fit")
    kv_cache = allocate_kv_cache(config, num_blocks, block_size, device=device)
    kv_cache.normal_(0.0, 1.0)
    return StepBench(config, model, kv_cache, num_blocks, block_size, max_model_len, weight_bytes_read(model))


def time_in_turns(calls: Sequence[Callable[[], object]], rounds: int, iters: int, trials: int = 5) -> list[list[float]]:
    """Per call, `rounds` device times per step in microseconds (back-to-back steps, the
    calls taking turns within each round)."""
    times: list[list[float]] = [[] for _ in calls]
    for _ in range(rounds):
        for index, call in enumerate(calls):
            ms, _ = pipelined_ms(call, warmup=3, iters=iters, trials=trials)
            times[index].append(ms * 1e3)
    return times


def summary_row(samples: list[float], gb_read: float, hbm_tbs: float) -> dict[str, object]:
    """Median, spread and roofline share of one variant's per-step times (us)."""
    median = statistics.median(samples)
    return {
        "median_us": round(median, 1),
        "min_us": round(min(samples), 1),
        "max_us": round(max(samples), 1),
        "roofline_pct": round(100 * gb_read / (median * 1e-6) / (hbm_tbs * 1e3), 1),
        "rounds_us": " ".join(f"{t:.1f}" for t in samples),
    }
