"""An engine built from a worker's typed config, and the KV layout it exposes to peers
(`kv_layout_of`, from `cleave.worker.kv_layout`)."""

from __future__ import annotations

import asyncio
from dataclasses import replace

from cleave.config import WorkerConfig
from cleave.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from cleave.engine.llm_engine import LLMEngine
from cleave.engine.memory_budget import InsufficientDeviceMemory
from cleave.model.source import ModelNotFound, resolve_model_dir
from cleave.worker.kv_layout import kv_layout_of
from cleave.worker.rank_processes import start_lockstep_engine

__all__ = ["engine_config_from_worker", "kv_layout_of", "load_engine"]


def engine_config_from_worker(config: WorkerConfig) -> EngineConfig:
    """EngineConfig of a prefill or decode worker (same math on both, so greedy tokens of a
    disaggregated request equal those of a colocated one)."""
    scheduler = SchedulerConfig(
        max_num_batched_tokens=config.max_num_batched_tokens,
        max_num_seqs=config.max_num_seqs,
        long_prefill_token_threshold=config.long_prefill_token_threshold,
        **({"max_model_len": config.model.max_context_length} if config.model.max_context_length else {}),
    )
    cache = CacheConfig(
        block_size=config.block_size,
        num_blocks=config.num_kv_blocks or None,
        gpu_memory_utilization=config.gpu_memory_utilization,
        kv_cache_dtype=config.kv_cache_dtype,
    )
    return EngineConfig(
        model=config.model.source,
        dtype=config.dtype,
        device=config.device,
        enforce_eager=config.enforce_eager,
        pdl=config.pdl,
        packed_experts=config.packed_experts,
        tensor_parallel_size=config.tensor_parallel_size,
        reasoning_parser=config.model.effective_reasoning_parser,
        stream_interval=config.stream_interval,
        # off CUDA the engine would run the padded forward eagerly (what its tests check): no gain
        prefill_graph_max_tokens=config.prefill_graph_max_tokens if config.device.startswith("cuda") else 0,
        scheduler=scheduler,
        cache=cache,
    )


async def load_engine(config: EngineConfig) -> LLMEngine:
    """Load weights and allocate the KV cache off the event loop.

    A worker whose device cannot give it its memory share exits with the reason (SystemExit:
    one line on stderr, exit code 1, no traceback); the server's shutdown still runs. So does
    one whose `--model` is neither a checkpoint directory nor a Hub id it can fetch
    (`cleave.model.source`). With `tensor_parallel_size` > 1 the other ranks start too
    (`cleave.worker.rank_processes`); the engine's `close()` stops them.
    """
    try:
        model_dir = await asyncio.to_thread(resolve_model_dir, config.model)
        build = start_lockstep_engine if config.tensor_parallel_size > 1 else LLMEngine
        return await asyncio.to_thread(build, replace(config, model=str(model_dir)))
    except ModelNotFound as error:
        raise SystemExit(f"error: {error}") from None
    except InsufficientDeviceMemory as error:
        raise SystemExit(f"error: {error}") from None
