"""Programmatic dependent launch (PDL) for the decode-step kernels.

A decode step at small batch is a chain of ~100 short kernels, and each one pays launch,
scheduling and ramp-up on top of its bytes. On Hopper and later a kernel launched with PDL
may start while the kernel before it is still running: its programs are scheduled and run up
to `wait_for_producer()` (griddepcontrol.wait), which returns once the previous kernel has
finished and its writes are visible. Nothing before that wait may read what an earlier
kernel writes or write what it reads.

Each kernel calls `wait_for_producer()` and then `release_dependents()`
(griddepcontrol.launch_dependents), so the next kernel's programs are scheduled as soon as
every program of this one is past its wait. Before the wait a kernel may only read what no
kernel of the step writes, or what it re-reads after the wait (decode attention's first KV
tile, `cleave.kernels.attention_decode`). The register GEMV (`cleave.kernels.gemv`) reads
only weights there and releases its dependents before waiting, so a third kernel may be
scheduled while it waits. Kernels launched without PDL (torch ops, cuBLAS) keep ordinary stream order around
them, and CUDA-graph capture records the dependency as a programmatic edge.

Off Hopper, on CPU tensors (the Triton interpreter) or with `enabled=False` the launch flag
is off and the kernels compile without these instructions. Whether PDL is wanted at all is
configuration (`EngineConfig.pdl`, the workers' `--pdl/--no-pdl`): the model carries it down
and passes it to every kernel call as `pdl=`.

Measured on an H200 (bench/results/decode/decode_pdl.md): 4-5% off a graph-replayed decode
step of a 1B model at batch 1-64 in one A/B, no difference beyond noise in a second one.
Prefetching the next projection's weights into L2 before the wait was tried and made the
step slower: at batch 32-64 from the attention and SwiGLU kernels
(bench/results/decode/deferred/prefetch_ab.md), and at batch 1 from the o projection beside
the attention (gate_up's leading rows or the next layer's qkv; Llama-3.2-1B 968.7 -> 981-1027
us, Qwen3-30B-A3B 2620 -> 2791 us on an H100; bench/results/decode/l2_prefetch_b1/).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl


@functools.lru_cache(maxsize=None)
def _capability_major(device_index: int) -> int:
    return torch.cuda.get_device_capability(device_index)[0]


def hopper_or_later(tensor: torch.Tensor) -> bool:
    """Whether `tensor` lives on a CUDA device of compute capability 9+ (PDL, bulk copies)."""
    return tensor.is_cuda and _capability_major(tensor.get_device()) >= 9


def pdl_enabled(tensor: torch.Tensor, enabled: bool = True) -> bool:
    """Whether kernels working on `tensor` launch with PDL: `enabled` (the caller's option) and
    a CUDA device of compute capability 9+."""
    return enabled and hopper_or_later(tensor)


def launch_options(pdl: bool) -> dict[str, bool]:
    """Extra keyword arguments of a `kernel[grid](...)` launch for `pdl`."""
    return {"launch_pdl": True} if pdl else {}


@triton.jit
def wait_for_producer(PDL: tl.constexpr):
    """Block until the previous kernel in the stream has finished and its writes are visible."""
    if PDL:
        tl.extra.cuda.gdc_wait()


@triton.jit
def release_dependents(PDL: tl.constexpr):
    """Let the next kernel's programs start (they wait in `wait_for_producer`)."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
