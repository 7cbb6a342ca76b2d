"""Plumbing shared by the prefill and decode workers: engine construction from the worker
config (`engine_setup`), engine outputs as per-step stream deltas (`deltas`), the prefill
side of the transport handshake (`handshake`) and start-up objects frozen out of the
garbage collector's walks (`gc_freeze`)."""

from cleave.worker.deltas import DeltaBuilder, top_logprobs_from_engine
from cleave.worker.engine_setup import engine_config_from_worker, kv_layout_of, load_engine
from cleave.worker.gc_freeze import FreezeAfterStart, freeze_startup_objects
from cleave.worker.handshake import PeerLink, TransportNegotiator, device_nccl

__all__ = [
    "DeltaBuilder",
    "FreezeAfterStart",
    "PeerLink",
    "TransportNegotiator",
    "device_nccl",
    "engine_config_from_worker",
    "freeze_startup_objects",
    "kv_layout_of",
    "load_engine",
    "top_logprobs_from_engine",
]
