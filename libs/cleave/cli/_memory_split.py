"""How `cleave up` splits a GPU's memory between the workers it places on that GPU.

Every worker process sizes its KV cache from `--gpu-memory-utilization`, its share of the
device's total memory (`cleave.engine.memory_budget`). Workers on one device must get
shares that sum to the stack's utilization (0.9 by default), or the second one to start
finds the first one's cache where its own should be. So the stack groups its GPU workers
by device and divides that device's utilization between them by role weight:

    1 prefill + 1 decode on cuda:0, split 1:2  ->  prefill-0 0.3, decode-0 0.6
    2 prefill + 2 decode on cuda:0, split 1:2  ->  prefill 0.15 each, decode 0.3 each
    colocated, 1 decode on cuda:0              ->  decode-0 0.9

Why decode weighs twice prefill by default: both roles load the same weights and profile
the same activation peak (the same step token budget), so the difference is the KV cache.
A decode worker keeps every running sequence's whole context for the length of its
generation (long reasoning outputs, up to max_num_seqs sequences at once); a prefill worker
keeps a prompt's blocks only until they are handed off, and its prefix cache is backed by
the kvstore. `--gpu-memory-split 1:1` gives every worker the same share.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

DEFAULT_GPU_MEMORY_UTILIZATION = 0.9


@dataclass(frozen=True)
class MemorySplit:
    """Relative weights of one prefill and one decode worker's share of a device they share."""

    prefill: float = 1.0
    decode: float = 2.0

    def __post_init__(self) -> None:
        if self.prefill <= 0 or self.decode <= 0:
            raise ValueError(f"memory split weights must be positive, got {self.prefill}:{self.decode}")

    @classmethod
    def parse(cls, text: str) -> MemorySplit:
        """'PREFILL:DECODE' weights, e.g. '1:2' or '1:1'."""
        prefill, separator, decode = text.partition(":")
        try:
            if not separator:
                raise ValueError
            return cls(float(prefill), float(decode))
        except ValueError:
            raise ValueError(f"expected PREFILL:DECODE positive weights such as 1:2, got {text!r}") from None

    def __str__(self) -> str:
        return f"{self.prefill:g}:{self.decode:g}"


@dataclass(frozen=True)
class PlacedWorker:
    """A worker the stack starts, and the torch device it runs on."""

    name: str  # "prefill-0", "decode-1"
    role: Literal["prefill", "decode"]
    device: str  # the worker's --device: "cpu", "cuda", "cuda:1"


def device_key(device: str) -> str | None:
    """The GPU a --device string names ("cuda" is the first visible one: "cuda:0"); None
    for devices without a memory budget (CPU)."""
    if not device.startswith("cuda"):
        return None
    return device if ":" in device else f"{device}:0"


def memory_shares(
    workers: Sequence[PlacedWorker], utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION,
    split: MemorySplit = MemorySplit(),
) -> dict[str, float]:
    """Each GPU worker's `--gpu-memory-utilization`: its device's `utilization` divided
    between the workers on that device in proportion to their role's weight. Workers on
    devices without a budget (CPU) are left out. Shares are rounded to 4 digits."""
    if not 0 < utilization <= 1:
        raise ValueError(f"GPU memory utilization must be in (0, 1], got {utilization}")
    by_device: dict[str, list[PlacedWorker]] = {}
    for worker in workers:
        key = device_key(worker.device)
        if key is not None:
            by_device.setdefault(key, []).append(worker)
    shares: dict[str, float] = {}
    for placed in by_device.values():
        total_weight = sum(getattr(split, worker.role) for worker in placed)
        for worker in placed:
            shares[worker.name] = round(utilization * getattr(split, worker.role) / total_weight, 4)
    return shares
