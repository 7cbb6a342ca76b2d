"""GEMV for one to a few rows: weight tiles streamed into registers, no tensor cores.

At batch 1-4 a decode projection is a pass over its weight matrix. `small_linear`'s
tensor-core kernel pads the rows to 16 and stages weight tiles through shared memory,
which keeps each program to one per SM and puts shared-memory round trips and a pipeline
ramp in front of every kernel. Here each program owns `BLOCK_N` output features, loads
their weight rows straight into registers in `BLOCK_K`-wide tiles (16-byte loads, the next
tile in flight while the current one is reduced) and multiplies with FMAs. Programs are
small and use no shared memory beyond the reduction, so several share an SM and a
programmatic-dependent launch can run them beside the previous kernel's tail.

That overlap is the point: weights are never written by an earlier kernel in the step, so
each program loads its first weight tile *before* `wait_for_producer()`, and a projection's
weight stream starts while the attention or projection before it is still finishing. Only
the activations (and the residual in the epilogue) are read after the wait. For the same
reason a program releases its dependents first thing, before its own wait: the next
kernel's programs may then be scheduled while this one still waits on its producer (their
own wait covers both, as this kernel cannot finish before its producer has).

Fusions and rounding are `small_linear`'s: `NORM` RMS-normalises the input rows first (the
normalised row rounded to the activation dtype, then scaled by the norm weight and rounded
again), `GATED` computes silu(gate) * up from a [2N, K] gate_up weight, `BIAS` adds a bias to
the fp32 product (loaded before the wait, as the weights are), `ADD` adds the rounded product
into the residual stream in place.

One more is the qkv projection's own: `ROTARY` (a `RotaryKVWrite`) applies the rotary
embedding to the q and k heads and writes k and v into their KV-cache slots, which is
`rotary_write_kv` after the projection, one launch fewer per layer. Each program then owns
rotary pairs rather than consecutive features (dims i and i + R/2 of a head in the NeoX
layout, 2i and 2i + 1 in GPT-J's; v heads and dims past the rotary width pair up
unrotated), so both halves of a rotation are in its registers. The rotation reads the
projection rounded to the activation dtype, as the unfused kernels do; q lands rotated in
the output (k and v there are not read again).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from cleave.kernels.kv_cache_dtype import to_cache
from cleave.kernels.pdl import release_dependents, wait_for_producer

MAX_ROWS = 4  # rows the register GEMV takes
AUTO_MAX_ROWS = 1  # rows `small_linear` sends here by default: at 2-4 rows the tensor-core kernel wins
TILE_ELEMENTS = 16384  # products per program per K tile ([rows, features, K]) the registers hold
MIN_PROGRAMS = 32  # programs a narrow projection's grid keeps (`gemv_tiles`)

# Streaming multiprocessors the interpreter (CPU tensors) decides `tiles_ahead` by: an H100's or H200's.
INTERPRETER_SMS = 132


def tiles_ahead(add: bool, k_tiles: int, programs: int, sms: int) -> int:
    """Weight tiles a program has in flight beyond the one it reduces, all loaded before its
    PDL wait: two where that is the program's whole weight slice (two K tiles) of a projection
    that adds into the residual stream and the grid is at most two programs an SM; one
    elsewhere. The o projection of Qwen3-30B-A3B (4096 wide, 256 programs) then has its whole
    weight in flight while the attention still runs: batch-1 step 2888 / 2892 -> 2825 / 2831
    us on an H100. Slower, so left at one (bench/results/decode/gemv_ahead/): gpt-oss-20b's o
    (360 programs, 23.6 MB in flight beside an attention that reads 128 tokens on half its
    layers) 3027 -> 3078 us; Llama-3.2-1B's four-tile down 0.997 -> 1.004 ms; gpt-oss-20b's
    non-adding two-tile projections (qkv, router, lm_head) as well 3045 -> 3077 us. The bound
    on programs separates the faster case from the slower; it is untested beyond them."""
    return 2 if add and k_tiles == 2 and programs <= 2 * sms else 1


def streaming_multiprocessors(tensor: torch.Tensor) -> int:
    """SMs of `tensor`'s GPU (INTERPRETER_SMS for CPU tensors)."""
    return _sm_count(tensor.get_device()) if tensor.is_cuda else INTERPRETER_SMS


@functools.lru_cache(maxsize=None)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


@dataclass(frozen=True)
class RotaryKVWrite:
    """Rotary embedding and KV-cache write, as the epilogue of a qkv projection."""

    positions: torch.Tensor  # [T] int64
    cos_sin_cache: torch.Tensor  # [max_pos, R] fp32: cos in the first R/2 columns, sin in the rest
    kv_cache: torch.Tensor  # [2, num_blocks, block_size, Hkv, D]
    slot_mapping: torch.Tensor  # [T] int64, -1 = padding (no write)
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    is_neox: bool = True


@triton.jit
def _dot_rows(x, w, BLOCK_M: tl.constexpr):
    """[BLOCK_M, BLOCK_K] x [BLOCK_N, BLOCK_K] -> [BLOCK_M, BLOCK_N] fp32, by FMAs."""
    if BLOCK_M == 1:
        return tl.sum(x.to(tl.float32) * w.to(tl.float32), axis=1)[None, :]
    return tl.sum(x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)


@triton.jit
def _weight_tile(w_rows, up_offset, tile: tl.constexpr, cols, feature_valid, num_in, BLOCK_K: tl.constexpr,
                 GATED: tl.constexpr):
    """K tile `tile` of the program's weight rows [BLOCK_N, BLOCK_K], and of their up half when
    GATED (else the same tile again)."""
    mask = feature_valid[:, None] & (tile * BLOCK_K + cols < num_in)[None, :]
    w = tl.load(w_rows + tile * BLOCK_K, mask=mask, other=0.0)
    w_up = w
    if GATED:
        w_up = tl.load(w_rows + up_offset + tile * BLOCK_K, mask=mask, other=0.0)
    return w, w_up


@triton.jit
def _input_tile(x_rows, tile: tl.constexpr, cols, row_valid, num_in, BLOCK_K: tl.constexpr):
    """K tile `tile` of the input rows [BLOCK_M, BLOCK_K], in their dtype."""
    mask = row_valid[:, None] & (tile * BLOCK_K + cols < num_in)[None, :]
    return tl.load(x_rows + tile * BLOCK_K, mask=mask, other=0.0)


@triton.jit
def _norm_weight_tile(norm_w_ptr, tile: tl.constexpr, cols, num_in, BLOCK_K: tl.constexpr):
    """K tile `tile` of the RMSNorm weight [BLOCK_K], in its dtype."""
    return tl.load(norm_w_ptr + tile * BLOCK_K + cols, mask=tile * BLOCK_K + cols < num_in, other=0.0)


@triton.jit
def gemv_product(
    x_rows,  # [BLOCK_M, BLOCK_K] pointers to the input rows' first tile
    w_rows,  # [BLOCK_N, BLOCK_K] pointers to the program's weight rows' first tile
    norm_w_ptr, bias_ptr, features, up_offset, cols, row_valid, feature_valid, num_in, eps,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, K_TILES: tl.constexpr,
    NORM: tl.constexpr, GATED: tl.constexpr, BIAS: tl.constexpr, PDL: tl.constexpr, AHEAD: tl.constexpr,
):
    """The register GEMV's pass over its program's weight rows, PDL wait included: (acc,
    acc_up) [BLOCK_M, BLOCK_N] fp32, the bias added to acc; acc_up is the up half's when
    GATED. Shared by `_gemv_kernel` and kernels that add their own epilogue."""
    # The next kernel may be scheduled at once, and the first weight tile (AHEAD of them) is
    # loaded before the wait: no kernel in the step writes weights.
    release_dependents(PDL)
    w, w_up = _weight_tile(w_rows, up_offset, 0, cols, feature_valid, num_in, BLOCK_K, GATED)
    ahead, ahead_up = w, w_up  # AHEAD == 2: the tile after the one reduced
    if AHEAD == 2 and K_TILES > 1:
        ahead, ahead_up = _weight_tile(w_rows, up_offset, 1, cols, feature_valid, num_in, BLOCK_K, GATED)
    bias = tl.zeros([BLOCK_N], dtype=tl.float32)
    if BIAS:
        bias = tl.load(bias_ptr + features, mask=feature_valid, other=0.0).to(tl.float32)
    norm_w_next = tl.zeros([BLOCK_K], dtype=x_rows.dtype.element_ty)  # NORM: the norm weight's first tile
    if NORM:
        norm_w_next = _norm_weight_tile(norm_w_ptr, 0, cols, num_in, BLOCK_K)
    wait_for_producer(PDL)
    if NORM:
        squares = tl.zeros([BLOCK_M], dtype=tl.float32)
        for t in tl.static_range(K_TILES):
            x = _input_tile(x_rows, t, cols, row_valid, num_in, BLOCK_K).to(tl.float32)
            squares += tl.sum(x * x, axis=1)
        rstd = tl.math.rsqrt(squares / num_in + eps)
    # the input's next tile goes out with the reduction of the one before it, not after:
    # loaded where it is reduced, its L2 round trip stood before every tile's FMAs
    x_next = _input_tile(x_rows, 0, cols, row_valid, num_in, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for t in tl.static_range(K_TILES):
        # tile t + AHEAD's loads go out before tile t is reduced
        if AHEAD == 2:
            next_w, next_w_up = ahead, ahead_up
            if t + 2 < K_TILES:
                ahead, ahead_up = _weight_tile(w_rows, up_offset, t + 2, cols, feature_valid, num_in, BLOCK_K, GATED)
        else:
            next_w, next_w_up = w, w_up
            if t + 1 < K_TILES:
                next_w, next_w_up = _weight_tile(w_rows, up_offset, t + 1, cols, feature_valid, num_in, BLOCK_K,
                                                 GATED)
        x = x_next
        norm_w = norm_w_next
        if t + 1 < K_TILES:
            x_next = _input_tile(x_rows, t + 1, cols, row_valid, num_in, BLOCK_K)
            if NORM:
                norm_w_next = _norm_weight_tile(norm_w_ptr, t + 1, cols, num_in, BLOCK_K)
        if NORM:
            normed = (x.to(tl.float32) * rstd[:, None]).to(x.dtype).to(tl.float32)
            x = (normed * norm_w.to(tl.float32)[None, :]).to(x.dtype)
        acc += _dot_rows(x, w, BLOCK_M)
        if GATED:
            acc_up += _dot_rows(x, w_up, BLOCK_M)
        w = next_w
        w_up = next_w_up
    if BIAS:
        acc += bias[None, :]
    return acc, acc_up


@triton.jit(do_not_specialize=["num_rows"])
def _gemv_kernel(
    x_ptr,  # [M, K] (NORM: the residual stream)
    w_ptr,  # [N, K] (GATED: [2N, K], gate rows then up rows)
    norm_w_ptr,  # [K] RMSNorm weight when NORM
    bias_ptr,  # [N] when BIAS
    out_ptr,  # [M, N]; ADD: the residual stream, updated in place
    positions_ptr,  # ROTARY: [M] positions
    cos_sin_ptr,  # ROTARY: [max_pos, 2 * ROT_HALF]
    cache_ptr,  # ROTARY: [2, num_blocks, block_size, Hkv, HEAD_DIM]
    slot_mapping_ptr,  # ROTARY: [M] int64, -1 = padding
    num_rows,
    num_out,  # N
    num_in,  # K
    stride_x_row,
    stride_w_row,
    stride_out_row,
    eps,
    stride_cos_sin,
    stride_cache_kv,
    stride_cache_block,
    stride_cache_slot,
    stride_cache_head,
    block_size,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    K_TILES: tl.constexpr,  # cdiv(K, BLOCK_K)
    NORM: tl.constexpr,
    GATED: tl.constexpr,
    BIAS: tl.constexpr,
    ADD: tl.constexpr,
    ROTARY: tl.constexpr,
    IS_NEOX: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    ROT_HALF: tl.constexpr,  # rotary_dim // 2
    NUM_Q_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    PDL: tl.constexpr,
    AHEAD: tl.constexpr,  # weight tiles in flight beyond the one reduced (1 or 2), as many before the wait
):
    if ROTARY:  # BLOCK_N // 2 rotary pairs, each pair's features side by side
        pair = tl.program_id(0) * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
        head = pair // (HEAD_DIM // 2)
        index = pair % (HEAD_DIM // 2)  # the pair's frequency when rotated
        rotated = (head < NUM_Q_HEADS + NUM_KV_HEADS) & (index < ROT_HALF)
        if IS_NEOX:
            first = tl.where(rotated, index, 2 * index)
            second = tl.where(rotated, index + ROT_HALF, 2 * index + 1)
        else:
            first = 2 * index
            second = 2 * index + 1
        features = tl.reshape(tl.join(head * HEAD_DIM + first, head * HEAD_DIM + second), [BLOCK_N])
    else:
        features = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    feature_valid = features < num_out
    cols = tl.arange(0, BLOCK_K)  # [BLOCK_K]
    rows = tl.arange(0, BLOCK_M)  # [BLOCK_M]
    row_valid = rows < num_rows
    w_rows = w_ptr + features.to(tl.int64)[:, None] * stride_w_row + cols[None, :]  # [BLOCK_N, BLOCK_K]
    up_offset = num_out.to(tl.int64) * stride_w_row
    x_rows = x_ptr + rows[:, None] * stride_x_row + cols[None, :]  # [BLOCK_M, BLOCK_K]

    acc, acc_up = gemv_product(x_rows, w_rows, norm_w_ptr, bias_ptr, features, up_offset, cols, row_valid,
                               feature_valid, num_in, eps, BLOCK_M, BLOCK_N, BLOCK_K, K_TILES, NORM, GATED, BIAS,
                               PDL, AHEAD)

    if ROTARY:
        _rotate_and_write_kv(
            acc, rows, row_valid, pair, head, index, rotated, first, second, out_ptr, stride_out_row, num_out,
            positions_ptr, cos_sin_ptr, cache_ptr, slot_mapping_ptr, stride_cos_sin, stride_cache_kv,
            stride_cache_block, stride_cache_slot, stride_cache_head, block_size,
            BLOCK_M, BLOCK_N, HEAD_DIM, ROT_HALF, NUM_Q_HEADS, NUM_KV_HEADS,
        )
        return
    if GATED:
        acc = acc / (1.0 + tl.exp(-acc)) * acc_up
    out_mask = row_valid[:, None] & feature_valid[None, :]
    out_ptrs = out_ptr + rows[:, None] * stride_out_row + features[None, :]
    result = acc.to(x_ptr.dtype.element_ty).to(out_ptr.dtype.element_ty)  # rounded as the activations
    if ADD:
        residual = tl.load(out_ptrs, mask=out_mask, other=0.0)
        result = (residual.to(tl.float32) + result.to(tl.float32)).to(out_ptr.dtype.element_ty)
    tl.store(out_ptrs, result, mask=out_mask)


@triton.jit
def _rotate_and_write_kv(
    acc, rows, row_valid, pair, head, index, rotated, first, second, out_ptr, stride_out_row, num_out,
    positions_ptr, cos_sin_ptr, cache_ptr, slot_mapping_ptr, stride_cos_sin, stride_cache_kv,
    stride_cache_block, stride_cache_slot, stride_cache_head, block_size,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, ROT_HALF: tl.constexpr,
    NUM_Q_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr,
):
    """ROTARY epilogue: rotate the pairs of q and k heads, store every pair into `out` and the
    k and v pairs into each row's cache slot."""
    dtype = out_ptr.dtype.element_ty
    x1, x2 = tl.split(tl.reshape(acc, [BLOCK_M, BLOCK_N // 2, 2]))  # [BLOCK_M, BLOCK_N // 2] each
    x1 = x1.to(dtype).to(tl.float32)
    x2 = x2.to(dtype).to(tl.float32)
    position = tl.load(positions_ptr + rows, mask=row_valid, other=0).to(tl.int64)  # [BLOCK_M]
    angle_mask = row_valid[:, None] & rotated[None, :]
    cos_sin = cos_sin_ptr + position[:, None] * stride_cos_sin + index[None, :]
    cos = tl.load(cos_sin, mask=angle_mask, other=1.0).to(tl.float32)
    sin = tl.load(cos_sin + ROT_HALF, mask=angle_mask, other=0.0).to(tl.float32)
    out1 = (x1 * cos - x2 * sin).to(dtype)  # unrotated pairs: cos 1, sin 0
    out2 = (x2 * cos + x1 * sin).to(dtype)

    pair_mask = row_valid[:, None] & (pair < num_out // 2)[None, :]
    first_cols = head * HEAD_DIM + first
    second_cols = head * HEAD_DIM + second
    out_rows = out_ptr + rows[:, None] * stride_out_row
    tl.store(out_rows + first_cols[None, :], out1, mask=pair_mask)
    tl.store(out_rows + second_cols[None, :], out2, mask=pair_mask)

    slot = tl.load(slot_mapping_ptr + rows, mask=row_valid, other=-1).to(tl.int64)  # [BLOCK_M]
    kv_index = head - NUM_Q_HEADS  # k heads, then v heads
    head_offset = (kv_index // NUM_KV_HEADS) * stride_cache_kv + (kv_index % NUM_KV_HEADS) * stride_cache_head
    slot_offset = (slot // block_size) * stride_cache_block + (slot % block_size) * stride_cache_slot
    dst = cache_ptr + slot_offset[:, None] + head_offset[None, :]  # [BLOCK_M, BLOCK_N // 2]
    kv_mask = pair_mask & (slot >= 0)[:, None] & (kv_index >= 0)[None, :]
    tl.store(dst + first[None, :], to_cache(out1, cache_ptr), mask=kv_mask)
    tl.store(dst + second[None, :], to_cache(out2, cache_ptr), mask=kv_mask)


def gemv_tiles(num_rows: int, num_out: int, num_in: int, gated: bool) -> tuple[int, int, int]:
    """(block_n, block_k, num_warps) for `num_rows` rows through an N x K projection.

    Measured on an H200 at one row (bench/results/decode/decode_gemv.md): rows up to 2048
    wide are one K tile, read by many small programs of 4 warps (4 features each, 2 per half
    when gated) that the PDL launch can start beside the previous kernel; wider rows (the
    down projection) take 8 features per program and 8 warps over double-buffered 2048-wide
    tiles. A narrow projection (a router) takes fewer features a program, down to one, so that
    its grid keeps `MIN_PROGRAMS` programs reading beside each other. More rows shrink the
    tile so the [rows, features, K] products stay in registers.
    """
    block_k = min(triton.next_power_of_2(num_in), 2048)
    multi_tile = triton.cdiv(num_in, block_k) > 1
    if multi_tile:
        block_n = 8
    else:
        block_n = 2 if gated else 4
    while block_n > (2 if gated else 1) and triton.cdiv(num_out, block_n) < MIN_PROGRAMS:
        block_n //= 2
    block_m = triton.next_power_of_2(num_rows)
    while block_m * block_n * block_k > TILE_ELEMENTS and block_n > 1:
        block_n //= 2
    while block_m * block_n * block_k > TILE_ELEMENTS and block_k > 256:
        block_k //= 2
    return min(block_n, triton.next_power_of_2(num_out)), block_k, 8 if multi_tile else 4
