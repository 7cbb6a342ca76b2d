"""KV cache blocks as flat bytes: gather a layer's blocks, scatter them back, dtype names.

The paged KV cache is `[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]`
(`cleave.kv.metadata`). A transfer moves, per layer, the K and V of a list of blocks: the
sender gathers them into one contiguous `[2, n, block_size, num_kv_heads, head_dim]` tensor,
the wire carries its raw little-endian bytes, the receiver scatters them into its own block
ids. Nothing here is pickled; bytes are reinterpreted through `uint8` views, and blocks are
scattered as integer words of the element's width (`as_words`), so a float8 cache moves as
any other (its dtype travels in the layout and the chunk headers, and must match).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from cleave.device_copy import tensor_on
from cleave.errors import InvalidArgument
from cleave.kernels.kv_cache_dtype import as_words

KV_CACHE_DIMS = 6  # [L, 2, NB, BS, Hkv, D]


def dtype_name(dtype: torch.dtype) -> str:
    """`torch.bfloat16` -> "bfloat16" (the names `cleave.rpc.convert` maps to the wire)."""
    return str(dtype).removeprefix("torch.")


def torch_dtype(name: str) -> torch.dtype:
    """"bfloat16" -> `torch.bfloat16`."""
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise InvalidArgument(f"unknown dtype {name!r}")
    return dtype


def check_kv_cache(cache: torch.Tensor) -> None:
    """Raise unless `cache` is a contiguous `[L, 2, NB, BS, Hkv, D]` KV cache."""
    if cache.dim() != KV_CACHE_DIMS or cache.shape[1] != 2:
        raise InvalidArgument(
            f"KV cache must be [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim], "
            f"got {list(cache.shape)}"
        )
    if not cache.is_contiguous():
        raise InvalidArgument("KV cache must be contiguous")


def layer_chunk_shape(cache: torch.Tensor, num_blocks: int, num_layers: int = 1) -> tuple[int, ...]:
    """Shape of gathered blocks: `[2, num_blocks, BS, Hkv, D]` for one layer,
    `[num_layers, 2, num_blocks, BS, Hkv, D]` for a run of layers."""
    one = (2, num_blocks, *cache.shape[3:])
    return one if num_layers <= 1 else (num_layers, *one)


def device_index(block_ids: Sequence[int], device: torch.device,
                 stream: torch.cuda.Stream | None = None) -> torch.Tensor:
    """Block ids as an int64 index tensor on `device`, without waiting for the device: on
    CUDA staged in pinned memory and copied asynchronously on `stream` (default: current),
    so only work queued on that stream after it sees the index.

    -> [n] int64
    """
    device = torch.device(device)
    if stream is None or device.type != "cuda":
        return tensor_on(list(block_ids), torch.int64, device)
    with torch.cuda.stream(stream):
        return tensor_on(list(block_ids), torch.int64, device)


def gather_layer(cache: torch.Tensor, layer: int, index: torch.Tensor) -> torch.Tensor:
    """K and V of blocks `index` of one layer as one contiguous tensor.

    cache: [L, 2, NB, BS, Hkv, D]; index: [n] int64 -> [2, n, BS, Hkv, D]
    """
    return as_words(cache[layer]).index_select(1, index).view(cache.dtype)


def scatter_layer(cache: torch.Tensor, layer: int, index: torch.Tensor, chunk: torch.Tensor) -> None:
    """Write a gathered chunk into blocks `index` of one layer, in place.

    cache: [L, 2, NB, BS, Hkv, D]; index: [n]; chunk: [2, n, BS, Hkv, D]
    """
    if chunk.dtype != cache.dtype:
        raise InvalidArgument(f"a {chunk.dtype} chunk for a {cache.dtype} KV cache: its bytes would be misread")
    as_words(cache[layer]).index_copy_(1, index, as_words(chunk))


def scatter_layers(cache: torch.Tensor, layers: range, index: torch.Tensor, chunk: torch.Tensor) -> None:
    """Write a gathered chunk of one layer or a run of layers into blocks `index`, in place.

    cache: [L, 2, NB, BS, Hkv, D]; index: [n];
    chunk: [2, n, BS, Hkv, D] for one layer, [len(layers), 2, n, BS, Hkv, D] for a run
    """
    if len(layers) == 1:
        scatter_layer(cache, layers.start, index, chunk)
        return
    for position, layer in enumerate(layers):
        scatter_layer(cache, layer, index, chunk[position])


def as_bytes(tensor: torch.Tensor) -> memoryview:
    """Zero-copy byte view of a contiguous CPU tensor (any dtype, bf16 included)."""
    if tensor.device.type != "cpu" or not tensor.is_contiguous():
        raise ValueError("as_bytes needs a contiguous CPU tensor")
    return memoryview(tensor.view(-1).view(torch.uint8).numpy()).cast("B")


def from_bytes(buffer: torch.Tensor, dtype: torch.dtype, shape: Sequence[int]) -> torch.Tensor:
    """Reinterpret a flat uint8 tensor as `dtype` with `shape` (no copy)."""
    return buffer.view(dtype).view(tuple(shape))
