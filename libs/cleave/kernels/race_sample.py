"""The exponential race of a batch of logits rows in one pass: temperature, counter-based
noise and the argmax in one kernel.

A sampled row draws token argmax_v p_v / q_v, with p = softmax(l / T) and q_v ~ Exp(1): the
exponential race, an exact sampler of p (`cleave.engine.sampler`). Its logarithm,
l_v / T - log q_v, has the same argmax and needs no softmax, so one pass reads each logit once
where the torch ops make about nine passes over [B, V] floats (softmax, the noise, its clamp,
the division, the argmax). The noise is `cleave.engine.counter_rng`'s: q_v = -log U_v, U_v
hashed from the row's 64-bit key and the token id, so a row given a seeded key draws the
token the torch path draws from the same key. A greedy row (T = 0) takes the argmax of its
logits.

The vocabulary is cut into `num_splits` chunks (more for fewer rows, so a batch of one still
spreads over the GPU). Program (chunk, row) keeps its chunk's best score and its first index
among equal scores, then counts itself done on the row's counter; the chunk that finishes
last picks the row's winner (the lowest index among equal scores, as torch.argmax) and
resets the counter. One launch. The chunk count is a runtime argument, so one compiled kernel
serves every batch size: with it a constexpr, an engine run met a new batch size class (and
paid a 0.3-1.3 s compile on the step) six times.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from cleave.kernels.dispatch import CachedLauncher

# Odd multipliers of counter_rng's 32-bit mixer (the same hash, so seeded rows agree).
_MUL_A = tl.constexpr(0x21F0AAAD)
_MUL_B = tl.constexpr(0x735A2D97)
TARGET_PROGRAMS = 512  # chunks x rows the split count aims for (a few per SM)
MAX_SPLITS = 64
BLOCK_V = 2048  # logits a program reads per loop turn


@triton.jit
def _mix32(values):
    """counter_rng._mix32 on uint32 lanes (products wrap mod 2**32)."""
    values = values ^ (values >> 16)
    values = values * _MUL_A
    values = values ^ (values >> 15)
    values = values * _MUL_B
    return values ^ (values >> 15)


@triton.jit(do_not_specialize=["num_splits"])
def _race_kernel(
    logits_ptr,  # [B, V] any float dtype
    temperatures_ptr,  # [B] fp32
    greedy_ptr,  # [B] bool: argmax of the logits
    keys_ptr,  # [B, 2] int64 (low, high) 32-bit words of each row's noise key
    part_score_ptr,  # [B, S] fp32
    part_index_ptr,  # [B, S] int32
    counters_ptr,  # [>= B] int32, zero between launches
    out_ptr,  # [B] int64
    vocab_size,
    stride_row,
    split_len,  # tokens a chunk covers, a multiple of BLOCK_V
    num_splits,  # chunks per row (the grid's first axis); a runtime value, so one compiled
    # kernel serves every batch size
    MAX_SPLITS: tl.constexpr,  # the merge's tile: at least num_splits
    BLOCK_V: tl.constexpr,
):
    split = tl.program_id(0)
    row = tl.program_id(1)
    row64 = row.to(tl.int64)
    greedy = tl.load(greedy_ptr + row) != 0
    inverse_t = 1.0 / tl.where(greedy, 1.0, tl.load(temperatures_ptr + row))
    low = tl.load(keys_ptr + 2 * row64).to(tl.uint32)
    high = tl.load(keys_ptr + 2 * row64 + 1).to(tl.uint32)
    row_ptr = logits_ptr + row64 * stride_row

    best_score = -float("inf")
    best_index = split * split_len  # where no score beats -inf, the chunk's first token
    start = split * split_len
    end = tl.minimum(start + split_len, vocab_size)
    for block in range(start, end, BLOCK_V):
        tokens = block + tl.arange(0, BLOCK_V)
        valid = tokens < end
        logits = tl.load(row_ptr + tokens, mask=valid, other=-float("inf")).to(tl.float32)
        hashed = _mix32(tokens.to(tl.uint32) ^ low)
        hashed = _mix32(hashed + high)
        uniform = ((hashed >> 9).to(tl.float32) + 0.5) * (1.0 / 8388608.0)
        noise = -tl.log(uniform)  # Exp(1)
        score = tl.where(greedy, logits, logits * inverse_t - tl.log(noise))
        score = tl.where(valid, score, -float("inf"))
        block_best = tl.max(score, axis=0)
        block_index = tl.min(tl.where(score == block_best, tokens, 2147483647), axis=0)
        if block_best > best_score:  # strictly: an earlier block keeps a tie
            best_score = block_best
            best_index = block_index

    if num_splits == 1:
        tl.store(out_ptr + row64, best_index.to(tl.int64))
    else:
        tl.store(part_score_ptr + row64 * num_splits + split, best_score)
        tl.store(part_index_ptr + row64 * num_splits + split, best_index)
        # Every partial is written before the counter moves (release); the chunk that moves
        # it last sees them all (acquire) and picks the winner.
        tl.debug_barrier()
        finished = tl.atomic_add(counters_ptr + row, 1, sem="acq_rel", scope="gpu")
        if finished == num_splits - 1:
            tl.debug_barrier()
            splits = tl.arange(0, MAX_SPLITS)
            present = splits < num_splits
            scores = tl.load(part_score_ptr + row64 * num_splits + splits, mask=present, other=-float("inf"),
                             volatile=True)
            indices = tl.load(part_index_ptr + row64 * num_splits + splits, mask=present, other=2147483647,
                              volatile=True)
            top = tl.max(scores, axis=0)
            winner = tl.min(tl.where(scores == top, indices, 2147483647), axis=0)
            tl.store(out_ptr + row64, winner.to(tl.int64))
            tl.atomic_xchg(counters_ptr + row, 0)


_race_launcher = CachedLauncher(_race_kernel)


def choose_race_splits(num_rows: int, vocab_size: int) -> int:
    """Chunks per row: a power of two bringing the grid to about TARGET_PROGRAMS, no more
    than the vocabulary has BLOCK_V-token blocks, at most MAX_SPLITS."""
    wanted = triton.next_power_of_2(triton.cdiv(TARGET_PROGRAMS, max(1, num_rows)))
    return max(1, min(wanted, MAX_SPLITS, triton.next_power_of_2(triton.cdiv(vocab_size, BLOCK_V))))


def race_sample(
    logits: torch.Tensor,  # [B, V]
    temperatures: torch.Tensor,  # [B] fp32
    is_greedy: torch.Tensor,  # [B] bool
    keys: torch.Tensor,  # [B, 2] int64 (low, high) 32-bit words
    counters: torch.Tensor | None = None,  # [>= B] int32 zeros, left zeroed
    num_splits: int | None = None,
    num_warps: int = 8,
) -> torch.Tensor:  # [B] int64
    """Each row's token: argmax of l / T - log(q) with q = -log U(key, token) (greedy rows:
    of l). `counters` (kept by the caller across launches) saves allocating zeros per call."""
    num_rows, vocab_size = logits.shape
    out = torch.empty(num_rows, dtype=torch.int64, device=logits.device)
    if num_rows == 0:
        return out
    if logits.stride(-1) != 1:
        raise ValueError("race_sample needs each logits row contiguous")
    if keys.shape != (num_rows, 2) or not keys.is_contiguous():
        raise ValueError(f"keys must be a contiguous [{num_rows}, 2] tensor, got {tuple(keys.shape)}")
    if num_splits is None:
        num_splits = choose_race_splits(num_rows, vocab_size)
    if num_splits < 1 or num_splits & (num_splits - 1) or num_splits > MAX_SPLITS:
        raise ValueError(f"num_splits must be a power of two up to {MAX_SPLITS}, got {num_splits}")
    split_len = triton.cdiv(triton.cdiv(vocab_size, num_splits), BLOCK_V) * BLOCK_V
    # Typed as when several chunks merge even where one chunk writes `out` itself: the
    # pointers' element types are part of the compiled kernel's signature.
    if counters is None or counters.numel() < num_rows:
        counters = torch.zeros(num_rows, dtype=torch.int32, device=logits.device)
    parts_score = torch.empty(num_rows, num_splits, dtype=torch.float32, device=logits.device)
    parts_index = torch.empty(num_rows, num_splits, dtype=torch.int32, device=logits.device)
    _race_launcher(
        (num_splits, num_rows),
        (logits, temperatures, is_greedy, keys, parts_score, parts_index, counters, out,
         vocab_size, logits.stride(0), split_len, num_splits),
        (MAX_SPLITS, BLOCK_V),
        num_warps,
    )
    return out
