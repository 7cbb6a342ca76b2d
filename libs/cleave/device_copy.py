"""Host -> device copies that never wait for the device.

A plain `tensor.to("cuda")` from pageable memory synchronizes the stream, so a step that
builds a small tensor while the previous forward runs would stall until that forward ends.
Copies here go through pinned memory from torch's caching host allocator (which keeps the
buffer until the queued copy has run) with `non_blocking=True`. The engine stages its step
inputs this way and the KV transfer its block indices.
"""

from __future__ import annotations

import torch


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`host` (a CPU tensor the caller does not modify afterwards) on `device`, queued
    without blocking; on CPU `host` itself."""
    if device.type == "cpu":
        return host
    if device.type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)


def tensor_on(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """`torch.tensor(values, dtype=dtype, device=device)` without a stream sync."""
    return to_device(torch.tensor(values, dtype=dtype), device)
