"""Plumbing shared by the prefill and decode workers: engine construction from the worker
config (`engine_setup`) and engine outputs as per-step stream deltas (`deltas`)."""

from cleave.worker.deltas import DeltaBuilder, top_logprobs_from_engine
from cleave.worker.engine_setup import engine_config_from_worker, kv_layout_of, load_engine

__all__ = [
    "DeltaBuilder",
    "engine_config_from_worker",
    "kv_layout_of",
    "load_engine",
    "top_logprobs_from_engine",
]
