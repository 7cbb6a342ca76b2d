"""Split-K for the decode-batch GEMV (`cleave.kernels.small_linear`): choosing the split count,
the K-slice of a program, and the fixed-order sum of the splits' partials.

At batch 1 a projection with few output tiles (Llama-3.2-1B qkv: 96 programs of 32
features) leaves most of a 132-SM GPU idle, and each busy SM has too few bytes in flight
to reach HBM bandwidth. Splitting K multiplies the programs: program (tile, split) streams
one BLOCK_K-aligned slice of K for its features and stores an fp32 partial into a
[SPLIT_K, M, W] workspace, then counts itself done on the tile's int32 counter; the
program that arrives last sums the partials in split order (deterministic, bit-identical
run to run), applies the epilogue and zeroes the counter for the next launch. This is the
last-arriver pattern of `attention_decode._paged_decode_split_kernel`.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

H200_NUM_SMS = 132
# Programs per SM the split count aims for (several per SM, so more weight bytes are in flight).
TARGET_PROGRAMS_PER_SM = 4
# A split streams at least this many BLOCK_K steps, so its partial and the reduction stay
# small next to the weight bytes it reads.
MIN_STEPS_PER_SPLIT = 2


@functools.lru_cache(maxsize=None)
def _cuda_num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def device_num_sms(device: torch.device) -> int:
    """SMs of a CUDA device; the H200's count elsewhere (the interpreter), so CPU tests see
    the same split choice as the GPU they stand in for."""
    if device.type != "cuda":
        return H200_NUM_SMS
    return _cuda_num_sms(device.index if device.index is not None else torch.cuda.current_device())


def default_split_k(num_out_tiles: int, num_in: int, block_k: int, num_sms: int = H200_NUM_SMS) -> int:
    """The largest power of two that keeps (tiles x splits) within TARGET_PROGRAMS_PER_SM per
    SM and gives every split at least MIN_STEPS_PER_SPLIT BLOCK_K steps; 1 for a large grid.

    Llama-3.2-1B, one row, bf16 (tiles of `default_tiles`): qkv 96 tiles x 4, o 128 x 2
    (K=2048 is four 512-wide steps), gate_up 256 x 2, down 128 x 4.
    """
    max_split = triton.cdiv(num_in, block_k) // MIN_STEPS_PER_SPLIT
    split = 1
    while split * 2 <= max_split and num_out_tiles * split * 2 <= TARGET_PROGRAMS_PER_SM * num_sms:
        split *= 2
    return split


def steps_per_split(num_in: int, block_k: int, split_k: int) -> int:
    """BLOCK_K steps in the longest K-slice (as `split_k_range` cuts it)."""
    return triton.cdiv(triton.cdiv(num_in, block_k), split_k)


@triton.jit
def split_k_range(num_in, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr):
    """[start, end) of K streamed by this program's split (program_id 1): whole BLOCK_K steps,
    so only the last slice ends inside a step, at `num_in`; [0, num_in) when SPLIT_K == 1."""
    if SPLIT_K == 1:
        return 0, num_in
    slice_len = tl.cdiv(tl.cdiv(num_in, BLOCK_K), SPLIT_K) * BLOCK_K
    start = tl.program_id(1) * slice_len
    return start, tl.minimum(num_in, start + slice_len)


@triton.jit
def store_partial(part_ptrs, acc, mask, split_stride):
    """Store this split's fp32 partial [BLOCK_M, BLOCK_N] at its split's plane of the workspace.

    part_ptrs: [BLOCK_M, BLOCK_N] pointers into split 0's plane; split_stride: elements per plane.
    """
    split = tl.program_id(1).to(tl.int64)
    tl.store(part_ptrs + split * split_stride, acc, mask=mask)


@triton.jit
def sum_partials(part_ptrs, mask, split_stride, SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Sum of every split's partial, added in split order -> [BLOCK_M, BLOCK_N] fp32.

    The loads bypass L1 (.cg): the other splits' partials were written by other SMs.
    """
    total = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for split in range(0, SPLIT_K):
        total += tl.load(part_ptrs + split * split_stride, mask=mask, other=0.0, cache_modifier=".cg")
    return total


def split_k_buffers(
    split_k: int,
    num_out_tiles: int,
    num_rows: int,
    part_width: int,  # N (gated: 2N)
    device: torch.device,
    counters: torch.Tensor | None,  # [>= num_out_tiles] int32, all zero; None: a zeroed one per call
) -> tuple[torch.Tensor, torch.Tensor]:
    """The fp32 partials workspace [split_k, M, part_width] and the tiles' counters for a
    split launch."""
    if counters is None:
        counters = torch.zeros(num_out_tiles, dtype=torch.int32, device=device)
    elif counters.dtype != torch.int32 or counters.numel() < num_out_tiles or counters.device != device:
        raise ValueError(
            f"counters must be a zeroed int32 tensor of at least {num_out_tiles} elements on {device}, got "
            f"{counters.dtype} [{counters.numel()}] on {counters.device}: enlarge the buffer or pass None"
        )
    partials = torch.empty((split_k, num_rows, part_width), dtype=torch.float32, device=device)
    return partials, counters
