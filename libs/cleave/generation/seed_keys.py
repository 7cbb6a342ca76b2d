"""Host-side keys of seeded sampling decisions, torch-free.

A seeded sample's random numbers are a pure function of (seed, sample index, step, token
id) (see `cleave.engine.counter_rng`). The first three mix into one 64-bit key per decision
here, so a gateway that moves a sample to another worker can hand over the key its stream
reached without loading torch.
"""

from __future__ import annotations

_MASK64 = 0xFFFFFFFFFFFFFFFF


def splitmix64(value: int) -> int:
    """SplitMix64 finalizer of a Python int (host side, exact 64-bit arithmetic)."""
    value = (value + 0x9E3779B97F4A7C15) & _MASK64
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & _MASK64
    return value ^ (value >> 31)


def row_key(seed: int, sample_index: int, step: int) -> int:
    """64-bit key of one sampling decision: sample `sample_index` of a request, output
    position `step`. Negative seeds are taken modulo 2**64."""
    key = splitmix64(seed & _MASK64)
    key = splitmix64(key ^ (sample_index & _MASK64))
    return splitmix64(key ^ (step & _MASK64))
