"""Fused device-to-device copy of KV blocks between two caches (CUDA IPC transport, local copy).

`dst[l, kv, dst_ids[i]] = src[l, kv, src_ids[i]]` for every layer l of a range, kv in {K, V},
and block pair i, in one kernel launch. Each block is read once and written once, where
`dst[:, :, dst_ids] = src[:, :, src_ids]` in torch would gather into a temporary first and
move every byte twice. The two caches may live in different allocations (one opened through
a CUDA IPC handle) and have different numbers of blocks; block shape and dtype must match.
`copy_blocks_reference` is the torch formulation the kernel is tested against.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from cleave.errors import InvalidArgument
from cleave.kernels.dispatch import CachedLauncher
from cleave.kernels.kv_cache_dtype import as_words

MAX_TILE = 2048


@triton.jit
def _copy_blocks_kernel(
    src_ptr, dst_ptr, src_ids_ptr, dst_ids_ptr,
    layer_start, num_blocks,
    src_layer_stride, src_kv_stride, src_block_stride,
    dst_layer_stride, dst_kv_stride, dst_block_stride,
    BLOCK_WORDS: tl.constexpr, TILE: tl.constexpr,
):
    # program (pid, tile): pid enumerates (layer, kv, block pair); tile a TILE-word slice
    pid = tl.program_id(0).to(tl.int64)
    tile = tl.program_id(1)
    pair = pid % num_blocks
    kv = (pid // num_blocks) % 2
    layer = layer_start + pid // (2 * num_blocks)
    src_block = tl.load(src_ids_ptr + pair).to(tl.int64)
    dst_block = tl.load(dst_ids_ptr + pair).to(tl.int64)
    offsets = tile * TILE + tl.arange(0, TILE)
    mask = offsets < BLOCK_WORDS
    src = src_ptr + layer * src_layer_stride + kv * src_kv_stride + src_block * src_block_stride
    dst = dst_ptr + layer * dst_layer_stride + kv * dst_kv_stride + dst_block * dst_block_stride
    tl.store(dst + offsets, tl.load(src + offsets, mask=mask), mask=mask)


_launcher = CachedLauncher(_copy_blocks_kernel)


def _word_view(cache: torch.Tensor) -> torch.Tensor:
    """The cache as the widest integer words its rows allow ([L, 2, NB, words_per_block])."""
    row_bytes = cache.shape[-1] * cache.element_size()
    word = torch.int32 if row_bytes % 4 == 0 else torch.int16 if row_bytes % 2 == 0 else torch.uint8
    flat = cache.view(*cache.shape[:3], -1)  # [L, 2, NB, BS*Hkv*D]
    return flat.view(word)


def _check(src: torch.Tensor, dst: torch.Tensor, src_ids: torch.Tensor, dst_ids: torch.Tensor) -> None:
    if src.dtype != dst.dtype or src.shape[3:] != dst.shape[3:] or src.shape[:2] != dst.shape[:2]:
        raise InvalidArgument(
            f"caches differ: src {src.dtype} {list(src.shape)} vs dst {dst.dtype} {list(dst.shape)}"
        )
    if src_ids.shape != dst_ids.shape or src_ids.dim() != 1:
        raise InvalidArgument("src_ids and dst_ids must be 1-D and of equal length")
    if not (src.is_contiguous() and dst.is_contiguous()):
        raise InvalidArgument("caches must be contiguous")


def copy_blocks_reference(
    src: torch.Tensor, dst: torch.Tensor, src_ids: torch.Tensor, dst_ids: torch.Tensor,
    layers: range,
) -> None:
    """Torch formulation: per layer, gather src blocks and scatter them into dst blocks (as
    integer words: CPU `index_copy_` has no float8 kernel)."""
    for layer in layers:
        as_words(dst[layer]).index_copy_(1, dst_ids, as_words(src[layer]).index_select(1, src_ids))


def copy_blocks(
    src: torch.Tensor, dst: torch.Tensor, src_ids: torch.Tensor, dst_ids: torch.Tensor,
    layers: range | None = None,
    use_kernel: bool | None = None,
) -> None:
    """Copy blocks src_ids -> dst_ids for `layers` (default all) on the current stream.

    src: [L, 2, NBs, BS, Hkv, D]; dst: [L, 2, NBd, BS, Hkv, D]; src_ids, dst_ids: [n] int64
    on the caches' device. `use_kernel` (default: on CUDA) picks the Triton kernel over the
    torch reference; CPU tests force it under TRITON_INTERPRET.
    """
    layers = range(src.shape[0]) if layers is None else layers
    _check(src, dst, src_ids, dst_ids)
    num_pairs = src_ids.numel()
    if num_pairs == 0 or len(layers) == 0:
        return
    if layers.step != 1 or layers.start < 0 or layers.stop > src.shape[0]:
        raise InvalidArgument(f"layers must be a contiguous range within [0, {src.shape[0]})")
    if not (src.device.type == "cuda" if use_kernel is None else use_kernel):
        copy_blocks_reference(src, dst, src_ids, dst_ids, layers)
        return
    src_words, dst_words = _word_view(src), _word_view(dst)
    block_words = src_words.shape[-1]
    tile = min(MAX_TILE, triton.next_power_of_2(block_words))
    grid = (len(layers) * 2 * num_pairs, triton.cdiv(block_words, tile))
    _launcher(
        grid,
        (src_words, dst_words, src_ids, dst_ids, layers.start, num_pairs,
         src_words.stride(0), src_words.stride(1), src_words.stride(2),
         dst_words.stride(0), dst_words.stride(1), dst_words.stride(2)),
        (block_words, tile),
        4,
    )

