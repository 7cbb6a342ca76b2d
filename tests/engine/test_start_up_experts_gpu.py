"""A mixture-of-experts engine on the GPU compiles its kernels at start-up: prompt steps of
every size up to the step budget, and the decode steps after them, meet no kernel variant
still to compile (`ModelRunner._warm_experts` runs one MoE block at each count of
`fused_moe.variant_token_counts`; a compile mid-serving stalls every request of its step)."""

from __future__ import annotations

import gc

import pytest
import torch

from cleave.engine.llm import LLM
from cleave.generation.sampling_params import SamplingParams
from cleave.testing.tiny_models import write_tiny_checkpoint
from tests.bench.bench_modules import imported_bench

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

BUDGET = 1024  # the step's token budget: prompt steps of up to this many tokens


def test_a_moe_engine_meets_no_kernel_to_compile_after_start_up(tmp_path):
    directory = write_tiny_checkpoint(tmp_path / "moe", architecture="qwen3-moe", dtype=torch.bfloat16)
    with imported_bench("compile_log") as compile_log, compile_log.CompileLog() as log:
        if not log.supported:
            pytest.skip("this triton has no JIT hooks to count compiles with")
        log.label = "start-up"
        llm = LLM(directory, device="cuda", gpu_memory_utilization=0.2, max_num_batched_tokens=BUDGET,
                  max_model_len=2048)
        try:
            log.label = "serving"
            params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
            # lone prompts of each length (one prompt step of that many tokens), then a batch
            # of several lengths at once (steps mixing prompts, then decode rows)
            for length in (1, 2, 3, 5, 9, 17, 33, 65, 129, 257, 513, BUDGET - 1):
                llm.generate([7] * length, params)
            llm.generate([[5 + index] * (3 + 37 * index) for index in range(24)], params)
        finally:
            del llm
            gc.collect()
            torch.cuda.empty_cache()
    assert any(event.label == "start-up" for event in log.events)  # the hooks saw the start-up's compiles
    serving = [(event.kernel, event.signature) for event in log.events if event.label == "serving"]
    assert serving == []
