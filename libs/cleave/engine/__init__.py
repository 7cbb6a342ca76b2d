"""cleave.engine: scheduler, model runner, sampler, reasoning, and the engines that tie them.

    LLM(model).generate(prompts, SamplingParams(...))     # offline, complete outputs
    LLMEngine(EngineConfig(...)).add_request / step       # one step at a time, delta outputs
    AsyncEngine(engine).submit(request_id, prompt, params)  # asyncio streams for services

Exports resolve lazily, so importing one submodule does not load torch-heavy siblings.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "AsyncEngine": "cleave.engine.async_engine",
    "CacheConfig": "cleave.engine.config",
    "EngineConfig": "cleave.engine.config",
    "SchedulerConfig": "cleave.engine.config",
    "LLM": "cleave.engine.llm",
    "build_engine_config": "cleave.engine.llm",
    "default_model_path": "cleave.engine.llm",
    "LLMEngine": "cleave.engine.llm_engine",
    "ModelRunner": "cleave.engine.model_runner",
    "StepStats": "cleave.engine.model_runner",
    "CompletionOutput": "cleave.generation.outputs",
    "FinishReason": "cleave.generation.outputs",
    "RequestOutput": "cleave.generation.outputs",
    "Usage": "cleave.generation.outputs",
    "SamplingParams": "cleave.generation.sampling_params",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'cleave.engine' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
