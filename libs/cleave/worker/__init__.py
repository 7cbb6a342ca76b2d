"""Plumbing shared by the prefill and decode workers: engine construction from the worker
config (`engine_setup`), engine outputs as per-step stream deltas (`deltas`) and the prefill
side of the transport handshake (`handshake`)."""

from cleave.worker.deltas import DeltaBuilder, top_logprobs_from_engine
from cleave.worker.engine_setup import engine_config_from_worker, kv_layout_of, load_engine
from cleave.worker.handshake import PeerLink, TransportNegotiator, device_nccl

__all__ = [
    "DeltaBuilder",
    "PeerLink",
    "TransportNegotiator",
    "device_nccl",
    "engine_config_from_worker",
    "kv_layout_of",
    "load_engine",
    "top_logprobs_from_engine",
]
