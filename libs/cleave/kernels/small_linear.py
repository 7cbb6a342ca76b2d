"""Linear layers for decode-sized batches (1-64 rows): weight-streaming Triton GEMV.

At a handful of rows a projection is a pass over its weight matrix, so time is bytes of
weight / HBM bandwidth, plus a few microseconds of launch and ramp per kernel. Each
program owns `BLOCK_N` output features and streams their weight rows (contiguous along K
in `nn.Linear`'s [N, K] layout) through a pipelined loop; the activations are padded to a
power of two of at least 16 rows for `tl.dot`. What would otherwise be separate kernels around the projection is fused:

- `norm_weight`: the input is the residual stream and is RMS-normalised on the fly (each
  program recomputes the rows' inverse RMS: the rows are a few KiB, the weights MiBs);
- `gated=True`: SwiGLU, the weight is gate_up ([2I, K], gate rows first) and each program
  computes both halves of its features and writes silu(gate) * up;
- `bias`: added to the fp32 product (not with `gated`), as `nn.Linear`'s before its rounding;
- `add_to`: the product is added in place into the residual stream (each program owns its
  features, so no two programs touch the same element) instead of being written out.

Rounding matches the unfused ops: the normalised input is rounded to the activation dtype
before the product, the product before it is added, the sum when it is stored (the split-K
kernel below scales the product by the inverse RMS instead: one rounding fewer).

`kernel="auto"` picks one of three kernels by row count: 17-64 rows go to the split-K kernel
of `cleave.kernels.splitk_linear` (each program a slice of K, so the [rows, K] activations
are not re-read from L2 in full by every feature block; the last split reduces), 2-16 rows to
the tensor-core kernel here, and a single row to the register GEMV of `cleave.kernels.gemv`,
which loads its first weight tile before waiting on the previous kernel: in a batch-1 step
of 16 Llama-3.2-1B layers the four projections take 564 us (81% of HBM) against 797 us
here (bench/results/decode/decode_gemv_chain.md). At 2-4 rows this kernel is faster.

On Hopper the kernel launches with programmatic dependent launch (`cleave.kernels.pdl`): its
programs are scheduled while the previous kernel finishes and wait on the device for its
output, so launch and ramp-up overlap the previous kernel's tail.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from cleave.kernels.attention_common import dot_settings
from cleave.kernels.dispatch import CachedLauncher, Impl, use_triton
from cleave.kernels.gemv import AUTO_MAX_ROWS as GEMV_AUTO_MAX_ROWS
from cleave.kernels.gemv import MAX_ROWS as GEMV_MAX_ROWS
from cleave.kernels.gemv import RotaryKVWrite, _gemv_kernel, gemv_tiles, streaming_multiprocessors, tiles_ahead
from cleave.kernels.linear_common import linear_tile, store_linear_output
from cleave.kernels.pdl import launch_options, pdl_enabled, release_dependents, wait_for_producer
from cleave.kernels.rms_norm import rms_norm_reference
from cleave.kernels.rotary_kv_write import rotary_write_kv_reference
from cleave.kernels.splitk_linear import launch_splitk_linear

MAX_ROWS = 64
# Above this many rows `kernel="auto"` takes the split-K kernel (cleave.kernels.splitk_linear).
SPLITK_MIN_ROWS = 17


@triton.jit(do_not_specialize=["num_rows"])
def _small_linear_kernel(
    x_ptr,  # [M, K] (NORM: the residual stream)
    w_ptr,  # [N, K] (GATED: [2N, K], gate rows then up rows)
    norm_w_ptr,  # [K] RMSNorm weight when NORM
    bias_ptr,  # [N] when BIAS
    out_ptr,  # [M, N]; ADD: the residual stream, updated in place
    num_rows,
    num_out,  # N: output features
    num_in,  # K
    stride_x_row,
    stride_w_row,
    stride_out_row,
    eps,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    NORM: tl.constexpr,
    GATED: tl.constexpr,
    BIAS: tl.constexpr,
    ADD: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    PDL: tl.constexpr,
):
    rows, features, row_valid, feature_valid, x_rows, w_rows, up_offset = linear_tile(
        x_ptr, w_ptr, tl.program_id(0), num_rows, num_out, stride_x_row, stride_w_row, BLOCK_M, BLOCK_N
    )
    wait_for_producer(PDL)
    release_dependents(PDL)

    if NORM:
        squares = tl.zeros([BLOCK_M], dtype=tl.float32)
        for k0 in range(0, num_in, BLOCK_K):
            cols = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(x_rows + cols[None, :], mask=row_valid[:, None] & (cols < num_in)[None, :], other=0.0)
            squares += tl.sum(x.to(tl.float32) * x.to(tl.float32), axis=1)
        rstd = tl.math.rsqrt(squares / num_in + eps)  # [BLOCK_M]

    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, num_in, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)  # [BLOCK_K]
        col_valid = cols < num_in
        x = tl.load(x_rows + cols[None, :], mask=row_valid[:, None] & col_valid[None, :], other=0.0)  # [BLOCK_M, BLOCK_K]
        if NORM:
            norm_w = tl.load(norm_w_ptr + cols, mask=col_valid, other=0.0).to(tl.float32)
            normed = (x.to(tl.float32) * rstd[:, None]).to(x.dtype).to(tl.float32)
            x = (normed * norm_w[None, :]).to(x.dtype)
        w_mask = feature_valid[:, None] & col_valid[None, :]
        x = x.to(DOT_DTYPE)
        w = tl.load(w_rows + cols[None, :], mask=w_mask, other=0.0).to(DOT_DTYPE)  # [BLOCK_N, BLOCK_K]
        acc = tl.dot(x, tl.trans(w), acc, input_precision=DOT_PRECISION)
        if GATED:
            w_up = tl.load(w_rows + up_offset + cols[None, :], mask=w_mask, other=0.0).to(DOT_DTYPE)
            acc_up = tl.dot(x, tl.trans(w_up), acc_up, input_precision=DOT_PRECISION)
    if BIAS:
        acc += tl.load(bias_ptr + features, mask=feature_valid, other=0.0).to(tl.float32)[None, :]

    store_linear_output(acc, acc_up, out_ptr, rows, features, row_valid, feature_valid, stride_out_row, GATED, ADD)


_launcher = CachedLauncher(_small_linear_kernel)
_gemv_launcher = CachedLauncher(_gemv_kernel)


def small_linear_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    gated: bool = False,
    norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    add_to: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """The unfused ops: [rms_norm] -> x @ weight.T [+ bias] (fp32, cast) -> [silu(gate) * up] -> [add_to +=]."""
    if norm_weight is not None:
        x = rms_norm_reference(x, norm_weight, eps)
    out = F.linear(x.float(), weight.float(), None if bias is None else bias.float())
    if gated:
        gate, up = out.chunk(2, dim=-1)
        out = F.silu(gate) * up
    out = out.to(x.dtype)
    if add_to is None:
        return out
    add_to.copy_((add_to.float() + out.float()).to(add_to.dtype))
    return add_to


def default_tiles(num_out: int, num_in: int, gated: bool, block_m: int = 16) -> tuple[int, int, int]:
    """(block_n, block_k, num_stages) measured best on an H200 for the Llama-3.2-1B projections.

    bench/results/kernels/small_linear.md: narrow outputs stream 16 features per program in
    512-wide steps (more programs in flight); wide or gated ones take 32 in 256-wide steps.
    More rows take narrower K steps so the pipelined activation tiles fit shared memory.
    """
    if block_m > 16:
        return (32, 128, 4) if gated else (16, 128, 4)
    if gated:
        return 32, 256, 3
    if num_out <= 2048:
        return 16, 512, 5
    return 32, 256, 5


SHARED_MEMORY_BUDGET = 192 << 10  # bytes of pipelined tiles per program (H100/H200: 227 KiB)


def _fit_stages(stages: int, block_m: int, weight_rows: int, block_k: int, element_size: int) -> int:
    """The most pipeline stages up to `stages` whose activation + weight tiles fit the budget."""
    per_stage = (block_m + weight_rows) * block_k * element_size
    return max(1, min(stages, SHARED_MEMORY_BUDGET // per_stage))


def small_linear(
    x: torch.Tensor,  # [M, K], M <= MAX_ROWS
    weight: torch.Tensor,  # [N, K] (gated: [2I, K])
    gated: bool = False,
    *,
    norm_weight: torch.Tensor | None = None,  # [K]: RMS-normalise x first
    eps: float = 1e-6,
    add_to: torch.Tensor | None = None,  # [M, N]: add the product into it in place
    bias: torch.Tensor | None = None,  # [N]: added to the product (not with gated)
    impl: Impl = "auto",
    block_n: int | None = None,
    block_k: int | None = None,
    num_warps: int | None = None,  # default 4
    num_stages: int | None = None,
    pdl: bool = True,  # launch with PDL where the device has it
    kernel: Literal["auto", "dot", "fma", "splitk"] = "auto",  # see the module doc
    rotary: RotaryKVWrite | None = None,  # qkv projection: rotate q, k and write k, v to the cache
    out_dtype: torch.dtype | None = None,  # register GEMV: store the (rounded) product as this dtype
    split_k: int | None = None,  # split-K kernel: K splits (default: fill the GPU)
    counters: torch.Tensor | None = None,  # split-K kernel: int32 zeros it may use and leaves zeroed
) -> torch.Tensor:  # [M, N] (gated: [M, I]); `add_to` itself when given
    """x @ weight.T for at most MAX_ROWS rows, with the fusions described in the module doc."""
    if bias is not None and (gated or bias.shape != (weight.shape[0],)):
        raise ValueError(f"bias must be [{weight.shape[0]}] and not with gated, got {tuple(bias.shape)}")
    if not use_triton(x, impl):
        out = small_linear_reference(x, weight, gated, norm_weight, eps, add_to, bias)
        if out_dtype is not None:
            out = out.to(out_dtype)
        if rotary is not None:
            _rotary_write_kv_reference(out, rotary)
        return out
    num_rows, num_in = x.shape
    if num_rows > MAX_ROWS:
        raise ValueError(f"small_linear takes at most {MAX_ROWS} rows, got {num_rows}")
    if weight.shape[1] != num_in or x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError(f"need x [M, {weight.shape[1]}] and weight [N, K] contiguous along K, got {tuple(x.shape)}")
    num_out = weight.shape[0] // 2 if gated else weight.shape[0]
    if kernel not in ("auto", "dot", "fma", "splitk"):
        raise ValueError(f"kernel must be 'auto', 'dot', 'fma' or 'splitk', got {kernel!r}")
    if out_dtype not in (None, x.dtype) and (add_to is not None or kernel in ("dot", "splitk")):
        raise ValueError("out_dtype is for the register GEMV's plain product (no add_to, kernel 'auto' or 'fma')")
    if add_to is None:
        out = torch.empty((num_rows, num_out), dtype=out_dtype or x.dtype, device=x.device)
    elif add_to.shape != (num_rows, num_out) or add_to.stride(1) != 1:
        raise ValueError(f"add_to must be [{num_rows}, {num_out}] and contiguous along features, got {tuple(add_to.shape)}")
    else:
        out = add_to
    if num_rows == 0:
        return out
    if rotary is not None:
        _check_rotary(rotary, num_rows, num_out, gated, add_to, kernel)
    if kernel == "fma" or rotary is not None or out.dtype != x.dtype or (
        kernel == "auto" and num_rows <= GEMV_AUTO_MAX_ROWS
    ):
        _launch_gemv(x, weight, norm_weight, bias, out, eps, gated, add_to is not None, block_n, block_k, num_warps,
                     pdl, rotary)
        return out
    dot_dtype, precision = dot_settings(x)  # the activations' dtype on a GPU; fp32 in the interpreter
    if kernel == "splitk" and bias is not None:
        raise ValueError("the split-K kernel adds no bias; pass kernel 'auto' or 'dot'")
    if kernel == "splitk" or (kernel == "auto" and num_rows >= SPLITK_MIN_ROWS and bias is None):
        launch_splitk_linear(x, weight, norm_weight, out, eps, gated, add_to is not None, dot_dtype, precision,
                             counters, block_n, block_k, split_k, num_warps, num_stages, pdl)
        return out
    block_m = max(16, triton.next_power_of_2(num_rows))
    tiles = default_tiles(num_out, num_in, gated, block_m)
    block_n = block_n or min(tiles[0], max(16, triton.next_power_of_2(num_out)))
    block_k = block_k or min(tiles[1] * 2 // x.element_size(), max(16, triton.next_power_of_2(num_in)))
    num_stages = num_stages or _fit_stages(tiles[2], block_m, block_n * (2 if gated else 1), block_k, x.element_size())
    pdl = pdl_enabled(x, pdl)
    _launcher(
        (triton.cdiv(num_out, block_n),),
        (x, weight, x if norm_weight is None else norm_weight, x if bias is None else bias, out,
         num_rows, num_out, num_in, x.stride(0), weight.stride(0), out.stride(0), eps),
        (block_m, block_n, block_k, norm_weight is not None, gated, bias is not None, add_to is not None, dot_dtype,
         precision, pdl),
        num_warps or 4, num_stages=num_stages, **launch_options(pdl),
    )
    return out


def _launch_gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    norm_weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    out: torch.Tensor,
    eps: float,
    gated: bool,
    add: bool,
    block_n: int | None,
    block_k: int | None,
    num_warps: int | None,
    pdl: bool,
    rotary: RotaryKVWrite | None,
) -> None:
    """`small_linear` through the register GEMV (cleave.kernels.gemv)."""
    num_rows, num_in = x.shape
    if num_rows > GEMV_MAX_ROWS:
        raise ValueError(f"the register GEMV takes at most {GEMV_MAX_ROWS} rows, got {num_rows}")
    num_out = out.shape[1]
    tiles = gemv_tiles(num_rows, num_out, num_in, gated)
    block_n = max(block_n or tiles[0], 2 if rotary else 1)
    block_k = block_k or tiles[1]
    pdl = pdl_enabled(x, pdl)
    if rotary is None:
        grid = triton.cdiv(num_out, block_n)
        rotary_tensors = (x, x, x, x)
        rotary_scalars = (0, 0, 0, 0, 0, 1)
        rotary_constexprs = (False, True, 2, 1, 1, 1)
    else:
        grid = triton.cdiv(num_out // 2, block_n // 2)
        cache = rotary.kv_cache
        rotary_tensors = (rotary.positions, rotary.cos_sin_cache, cache, rotary.slot_mapping)
        rotary_scalars = (rotary.cos_sin_cache.stride(0), cache.stride(0), cache.stride(1), cache.stride(2),
                          cache.stride(3), cache.shape[2])
        rotary_constexprs = (True, rotary.is_neox, rotary.head_dim, rotary.cos_sin_cache.shape[-1] // 2,
                             rotary.num_q_heads, rotary.num_kv_heads)
    k_tiles = triton.cdiv(num_in, block_k)
    ahead = tiles_ahead(add, k_tiles, grid, streaming_multiprocessors(x))
    _gemv_launcher(
        (grid,),
        (x, weight, x if norm_weight is None else norm_weight, x if bias is None else bias, out, *rotary_tensors,
         num_rows, num_out, num_in, x.stride(0), weight.stride(0), out.stride(0), eps, *rotary_scalars),
        (triton.next_power_of_2(num_rows), block_n, block_k, k_tiles,
         norm_weight is not None, gated, bias is not None, add, *rotary_constexprs, pdl, ahead),
        num_warps or tiles[2], num_stages=1, **launch_options(pdl),
    )


def _check_rotary(
    rotary: RotaryKVWrite, num_rows: int, num_out: int, gated: bool, add_to: torch.Tensor | None, kernel: str
) -> None:
    heads = rotary.num_q_heads + 2 * rotary.num_kv_heads
    rotary_dim = rotary.cos_sin_cache.shape[-1]
    if gated or add_to is not None or kernel in ("dot", "splitk"):
        raise ValueError("rotary is the qkv projection's epilogue: not with gated, add_to or kernel 'dot' or 'splitk'")
    if num_out != heads * rotary.head_dim or rotary.head_dim % 2:
        raise ValueError(f"rotary: weight has {num_out} outputs, expected (Hq + 2 Hkv) x head_dim = "
                         f"{heads} x {rotary.head_dim} with an even head_dim")
    if rotary_dim > rotary.head_dim or rotary_dim % 2:
        raise ValueError(f"rotary: need an even rotary_dim <= head_dim, got {rotary_dim} vs {rotary.head_dim}")
    if rotary.positions.shape[0] < num_rows or rotary.slot_mapping.shape[0] < num_rows:
        raise ValueError(f"rotary: positions and slot_mapping need {num_rows} rows")
    if rotary.kv_cache.shape[-2:] != (rotary.num_kv_heads, rotary.head_dim) or rotary.kv_cache.stride(-1) != 1:
        raise ValueError(f"rotary: kv_cache must be [2, blocks, block_size, {rotary.num_kv_heads}, "
                         f"{rotary.head_dim}] with unit stride along head_dim, got {tuple(rotary.kv_cache.shape)}")


def _rotary_write_kv_reference(qkv: torch.Tensor, rotary: RotaryKVWrite) -> None:
    """The unfused ops on a projection's output: rotate q and k, write k and v to the cache."""
    q_size = rotary.num_q_heads * rotary.head_dim
    kv_size = rotary.num_kv_heads * rotary.head_dim
    rows = qkv.shape[0]
    q, k, v = (part.view(rows, -1, rotary.head_dim) for part in qkv.split([q_size, kv_size, kv_size], dim=-1))
    rotary_write_kv_reference(q, k, v, rotary.positions[:rows], rotary.cos_sin_cache, rotary.kv_cache,
                              rotary.slot_mapping[:rows], rotary.is_neox)
