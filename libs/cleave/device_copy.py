"""Copies between host and device that never wait for the device.

A plain `tensor.to("cuda")` from pageable memory synchronizes the stream, so a step that
builds a small tensor while the previous forward runs would stall until that forward ends.
Copies here go through pinned memory from torch's caching host allocator (which keeps the
buffer until the queued copy has run) with `non_blocking=True`. The engine stages its step
inputs this way and the KV transfer its block indices; `to_host` is the way back (sampled
ids, KV blocks for the kvstore or TCP), valid once the stream passes the copy.
"""

from __future__ import annotations

from array import array

import torch

# array typecodes of the index dtypes: `torch.frombuffer(array(...))` builds a CPU tensor
# from a list of ints about 3x faster than `torch.tensor(list)`
_ARRAY_CODES = {torch.int64: "q", torch.int32: "i"}


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
    code = _ARRAY_CODES.get(dtype)
    if code is None or not values or not isinstance(values[0], int):  # nested or empty: torch's way
        return to_device(torch.tensor(values, dtype=dtype), device)
    return to_device(torch.frombuffer(array(code, values), dtype=dtype), device)


def to_host(tensor: torch.Tensor) -> torch.Tensor:
    """A host copy of `tensor` queued on the current stream into pinned memory (read it only
    after that stream passed this point, e.g. an event recorded after); a CPU tensor itself."""
    if not tensor.is_cuda:
        return tensor
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    host.copy_(tensor, non_blocking=True)
    return host
