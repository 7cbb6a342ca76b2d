"""KV layouts against caches: both ends of a transfer must hold identical block bytes."""

from __future__ import annotations

import torch

from cleave.errors import FailedPrecondition
from cleave.rpc.types import KVLayout
from cleave.transfer.tensors import check_kv_cache, dtype_name

LAYOUT_FIELDS = ("model_id", "dtype", "block_size", "num_layers", "num_kv_heads", "head_dim", "hash_namespace")


def layout_of(cache: torch.Tensor, model_id: str, hash_namespace: str = "") -> KVLayout:
    """The KVLayout a `[L, 2, NB, BS, Hkv, D]` cache of `model_id` has."""
    check_kv_cache(cache)
    num_layers, _, _, block_size, num_kv_heads, head_dim = cache.shape
    return KVLayout(
        model_id=model_id, dtype=dtype_name(cache.dtype), block_size=block_size,
        num_layers=num_layers, num_kv_heads=num_kv_heads, head_dim=head_dim,
        hash_namespace=hash_namespace,
    )


def layout_mismatch(expected: KVLayout, actual: KVLayout) -> str | None:
    """Name of the first field where two layouts differ, or None when equal."""
    for name in LAYOUT_FIELDS:
        if getattr(expected, name) != getattr(actual, name):
            return name
    return None


def require_same_layout(expected: KVLayout, actual: KVLayout, what: str = "layout") -> None:
    """Raise FailedPrecondition naming the first differing field."""
    name = layout_mismatch(expected, actual)
    if name is not None:
        raise FailedPrecondition(
            f"KV layouts differ in {name}: {getattr(expected, name)!r} here, "
            f"{getattr(actual, name)!r} offered; KV moves only between equal layouts",
            field=f"{what}.{name}",
        )


def check_layout(layout: KVLayout, cache: torch.Tensor) -> None:
    """Raise FailedPrecondition unless `cache` has the shape and dtype `layout` describes."""
    require_same_layout(layout, layout_of(cache, layout.model_id, layout.hash_namespace))
