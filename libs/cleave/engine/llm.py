"""Offline generation: `LLM(model_path, **engine_kwargs).generate(prompts, params)`.

    llm = LLM("path/to/model", max_model_len=4096)
    outputs = llm.generate(["Hello", "What is 2+2?"], SamplingParams(max_tokens=32))
    outputs[0].outputs[0].text

Each returned `RequestOutput` is complete (delta=False), in the order of the prompts.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from pathlib import Path
from typing import Any

import torch

from cleave.config import SHIPPED_MODEL_DIR
from cleave.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from cleave.engine.frozen_heap import frozen_heap
from cleave.engine.llm_engine import LLMEngine, Prompt
from cleave.engine.request import OutputAccumulator
from cleave.generation.outputs import RequestOutput
from cleave.generation.sampling_params import SamplingParams
from cleave.model.source import resolve_model_dir

_SCHEDULER_KEYS = ("max_num_batched_tokens", "max_num_seqs", "max_model_len", "enable_chunked_prefill")
_CACHE_KEYS = ("block_size", "num_blocks", "enable_prefix_caching", "gpu_memory_utilization", "kv_cache_dtype")
_ENGINE_KEYS = (
    "dtype", "device", "seed", "enforce_eager", "detokenize", "overlap_steps", "pdl", "tensor_parallel_size",
    "reasoning_parser", "stream_interval", "stagger_reports", "prefill_graph_max_tokens", "packed_experts",
)


# `LLM.generate` reads a request's output once it has finished, so its engine reports running
# requests only every this many steps (EngineConfig.stream_interval), and makes their text
# then, a run of tokens at once: a third less host work per step at batch 256 (1.45 vs 0.96 ms
# mean, bench/results/engine/engine-host-20261204T163027Z.md). A first report and every end
# still come at once. Each request reports on its own phase of the 64 steps
# (EngineConfig.stagger_reports), so no step carries every request's text: at batch 256 / 512
# on an H200 the GPU idled 5.3 / 14.8% of the decode steps with one reporting step, 0.3 / 4.4%
# staggered (bench/results/engine/engine-step-gaps-20261204T192522Z.md).
BATCH_STREAM_INTERVAL = 64


def default_model_path() -> Path | None:
    """The reasoning model shipped with cleave (`cleave/assets/reasoner`), if present."""
    return SHIPPED_MODEL_DIR if (SHIPPED_MODEL_DIR / "config.json").is_file() else None


def build_engine_config(model: str | Path, **kwargs: Any) -> EngineConfig:
    """EngineConfig from flat keyword arguments (SchedulerConfig, CacheConfig and
    EngineConfig field names). device defaults to "cuda" when available, else "cpu";
    dtype to "auto" (the checkpoint's dtype on CUDA, float32 on CPU). `model` is a checkpoint
    directory or a Hugging Face Hub id ORG/NAME[@REVISION] (`cleave.model.source`)."""
    unknown = set(kwargs) - set(_SCHEDULER_KEYS) - set(_CACHE_KEYS) - set(_ENGINE_KEYS)
    if unknown:
        raise TypeError(f"unknown engine arguments: {', '.join(sorted(unknown))}")
    scheduler_args = {k: kwargs[k] for k in _SCHEDULER_KEYS if kwargs.get(k) is not None}
    if not scheduler_args.get("enable_chunked_prefill", True) and "max_num_batched_tokens" not in scheduler_args:
        scheduler_args["max_num_batched_tokens"] = scheduler_args.get("max_model_len", SchedulerConfig.max_model_len)
    cache_args = {k: kwargs[k] for k in _CACHE_KEYS if kwargs.get(k) is not None}
    engine_args = {k: kwargs[k] for k in _ENGINE_KEYS if kwargs.get(k) is not None}
    engine_args.setdefault("device", "cuda" if torch.cuda.is_available() else "cpu")
    engine_args.setdefault("dtype", "auto")
    return EngineConfig(
        model=str(resolve_model_dir(str(model))),
        scheduler=SchedulerConfig(**scheduler_args),
        cache=CacheConfig(**cache_args),
        **engine_args,
    )


class LLM:
    """An in-process engine for batch generation.

    Args:
        model: checkpoint directory (HF layout).
        **engine_kwargs: see `build_engine_config` (max_model_len, max_num_seqs, block_size,
            num_blocks, kv_cache_dtype, device, dtype, seed, enforce_eager, detokenize,
            overlap_steps, pdl, tensor_parallel_size, reasoning_parser, stream_interval (default
            `BATCH_STREAM_INTERVAL`), stagger_reports (default True), ...).
    """

    def __init__(self, model: str | Path, **engine_kwargs: Any) -> None:
        engine_kwargs.setdefault("stream_interval", BATCH_STREAM_INTERVAL)
        engine_kwargs.setdefault("stagger_reports", True)
        self.engine = LLMEngine(build_engine_config(model, **engine_kwargs))
        self._next_id = 0

    @property
    def tokenizer(self):  # type: ignore[no-untyped-def]
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Seq[Prompt],
        params: SamplingParams | Seq[SamplingParams] | None = None,
        *,
        raw: bool = False,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; one complete RequestOutput per prompt, in order.

        A single prompt (a string, a token-id list or a message list) may be passed bare;
        `params` is one SamplingParams for all prompts or one per prompt. The engine steps with
        the objects alive before the loop frozen (`cleave.engine.frozen_heap`), so the garbage
        collector's full walks skip the model and the libraries.
        """
        prompt_list = [prompts] if _is_single_prompt(prompts) else list(prompts)  # type: ignore[list-item]
        if params is None or isinstance(params, SamplingParams):
            param_list = [params or SamplingParams()] * len(prompt_list)
        else:
            param_list = list(params)
            if len(param_list) != len(prompt_list):
                raise ValueError(f"got {len(param_list)} SamplingParams for {len(prompt_list)} prompts")
        accumulators: dict[str, OutputAccumulator] = {}
        order = []
        try:
            for prompt, sampling in zip(prompt_list, param_list):
                request_id = f"llm-{self._next_id}"
                self._next_id += 1
                self.engine.add_request(request_id, prompt, sampling, raw=raw)
                accumulators[request_id] = OutputAccumulator(request_id)
                order.append(request_id)
            with frozen_heap():
                while self.engine.has_unfinished():
                    for output in self.engine.step():
                        if output.request_id in accumulators:
                            accumulators[output.request_id].add(output)
        except BaseException:
            for request_id in order:
                self.engine.abort(request_id)
            raise
        return [accumulators[request_id].result() for request_id in order]


def _is_single_prompt(prompts: Any) -> bool:
    if isinstance(prompts, str):
        return True
    if isinstance(prompts, Seq) and prompts and isinstance(prompts[0], (int, dict)):
        return True
    return False
