"""How many KV blocks one engine may allocate on a device it may share with other workers.

`gpu_memory_utilization` is this process's share of the device's *total* memory: its
weights, its activation peak, its KV cache and a fixed headroom (CUDA context, graph pools,
allocator fragmentation) must fit in `fraction * total_bytes`. Nothing here reads what other
processes hold, so two workers that start at the same time on one GPU (a prefill and a
decode worker under `cleave up`) each size their cache from their own share, and neither
counts the free memory the other is about to take. Shares that sum to at most 1 therefore
fit together, whatever order the workers start in.

What other processes hold matters once, as a start-up check: the memory this process still
has to allocate (its share minus what it already holds) must be free now. If it is not,
another process took part of this worker's share, and the worker refuses to start with
`InsufficientDeviceMemory` rather than failing later with an out-of-memory error mid-step.

    memory = DeviceMemory("cuda:0", free_bytes, total_bytes, held_bytes)   # one reading
    num_blocks = kv_blocks_for_share(memory, fraction, peak_bytes, bytes_per_block)
"""

from __future__ import annotations

from dataclasses import dataclass

from cleave.errors import ResourceExhausted

# Headroom left free besides the profiled peak: CUDA context, graph pools, allocator fragmentation.
CUDA_HEADROOM_BYTES = 512 << 20
GIB = 2**30


class InsufficientDeviceMemory(ResourceExhausted):
    """A worker cannot get its share of device memory at start-up (the message says why and
    how to fix it)."""


@dataclass(frozen=True)
class DeviceMemory:
    """One reading of a device's memory, taken after the weights are loaded.

    Attributes:
        device: the device's name in messages, e.g. "cuda:0".
        free_bytes: free on the device now (`torch.cuda.mem_get_info`), all processes counted.
        total_bytes: the device's capacity.
        held_bytes: what this process's allocator holds now (weights and buffers;
            `torch.cuda.memory_reserved`). The CUDA context is not in it: the headroom covers it.
    """

    device: str
    free_bytes: int
    total_bytes: int
    held_bytes: int


def kv_blocks_for_share(
    memory: DeviceMemory,
    fraction: float,
    peak_activation_bytes: int,
    bytes_per_block: int,
    headroom_bytes: int = CUDA_HEADROOM_BYTES,
) -> int:
    """KV blocks (including the reserved null block 0) that fit in this process's share.

    share = fraction * total; KV bytes = share - held - peak - headroom. Raises
    InsufficientDeviceMemory when the share leaves no room for two blocks after the weights
    and activations, or when the device does not have `share - held` bytes free now.
    """
    share_bytes = fraction * memory.total_bytes
    kv_bytes = share_bytes - memory.held_bytes - peak_activation_bytes - headroom_bytes
    num_blocks = int(kv_bytes // bytes_per_block) + 1 if kv_bytes > 0 else 0
    if num_blocks < 2:
        raise InsufficientDeviceMemory(
            f"{_share_text(memory, fraction)} leaves no room for the KV cache: weights and buffers take "
            f"{memory.held_bytes / GIB:.2f} GiB, the activation peak {peak_activation_bytes / GIB:.2f} GiB and the "
            f"headroom {headroom_bytes / GIB:.2f} GiB ({kv_bytes / GIB:.2f} GiB left). Raise --gpu-memory-utilization "
            "(with `cleave up`: --gpu-memory-utilization or --gpu-memory-split), lower --max-num-batched-tokens / "
            "--max-num-seqs, or pass --num-kv-blocks"
        )
    still_needed = share_bytes - memory.held_bytes
    if memory.free_bytes < still_needed:
        raise InsufficientDeviceMemory(
            f"{memory.device} has {memory.free_bytes / GIB:.2f} GiB free of {memory.total_bytes / GIB:.2f} GiB, but "
            f"{_share_text(memory, fraction)} needs {still_needed / GIB:.2f} GiB more than the "
            f"{memory.held_bytes / GIB:.2f} GiB this worker holds: another process is using the device. Lower "
            "--gpu-memory-utilization (with `cleave up`: --gpu-memory-utilization or --gpu-memory-split), stop the "
            "other process, or pass --num-kv-blocks to size the KV cache by hand"
        )
    return num_blocks


def _share_text(memory: DeviceMemory, fraction: float) -> str:
    return (f"this worker's share of {memory.device} (--gpu-memory-utilization {fraction:g}: "
            f"{fraction * memory.total_bytes / GIB:.2f} GiB of {memory.total_bytes / GIB:.2f} GiB)")
