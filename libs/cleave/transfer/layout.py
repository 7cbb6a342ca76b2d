"""KV layouts against caches: both ends of a transfer must hold identical block bytes."""

from __future__ import annotations

import torch

from cleave.errors import FailedPrecondition
from cleave.rpc.types import KVLayout
from cleave.transfer.tensors import check_kv_cache, dtype_name

LAYOUT_FIELDS = ("model_id", "dtype", "block_size", "num_layers", "num_kv_heads", "head_dim", "hash_namespace")
_FIELDS_BUT_HEADS = tuple(name for name in LAYOUT_FIELDS if name != "num_kv_heads")
# how to fix a mismatch, where the layouts come from worker flags: a cache's dtype is the
# weights' (--dtype) unless --kv-cache-dtype makes it fp8, and its bytes mean nothing in another
_FIXES = {"dtype": " (start prefill and decode workers with the same --dtype and --kv-cache-dtype)"}


def layout_of(cache: torch.Tensor, model_id: str, hash_namespace: str = "", kv_head_start: int = 0,
              total_kv_heads: int = 0) -> KVLayout:
    """The KVLayout a `[L, 2, NB, BS, Hkv, D]` cache of `model_id` has (holding the model's
    heads `kv_head_start` .. + Hkv - 1 of `total_kv_heads`; 0: all of them)."""
    check_kv_cache(cache)
    num_layers, _, _, block_size, num_kv_heads, head_dim = cache.shape
    return KVLayout(
        model_id=model_id, dtype=dtype_name(cache.dtype), block_size=block_size,
        num_layers=num_layers, num_kv_heads=num_kv_heads, head_dim=head_dim,
        hash_namespace=hash_namespace, kv_head_start=kv_head_start, total_kv_heads=total_kv_heads,
    )


def head_slice(source: KVLayout, destination: KVLayout, what: str = "layout") -> slice | None:
    """The slice of the source cache's head axis the destination holds: None when both hold
    the same heads (the blocks move whole), else `source heads[a:b]`.

    Raises FailedPrecondition, at connect, for layouts that cannot be mapped: any field but
    the heads differs, the two hold heads of models with different head counts, or the
    destination holds a head the source does not (a decode rank's heads come from one
    prefill worker: TP=2 -> TP=1 would need two senders)."""
    name = layout_mismatch(source, destination, fields=_FIELDS_BUT_HEADS)
    if name is not None:
        raise FailedPrecondition(
            f"KV layouts differ in {name}: the sender's {getattr(source, name)!r}, the receiver's "
            f"{getattr(destination, name)!r}; KV moves only between equal layouts{_FIXES.get(name, '')}",
            field=f"{what}.{name}")
    if source.model_kv_heads != destination.model_kv_heads:
        raise FailedPrecondition(
            f"KV layouts are of models with {source.model_kv_heads} and {destination.model_kv_heads} KV heads",
            field=f"{what}.total_kv_heads")
    have, want = source.heads, destination.heads
    if want.start < have.start or want.stop > have.stop:
        raise FailedPrecondition(
            f"the receiver holds KV heads {_span(want)} and this sender {_span(have)}: a receiver's heads "
            f"must all come from one sender", field=f"{what}.kv_head_start")
    if want == have:
        return None
    return slice(want.start - have.start, want.stop - have.start)


def _span(heads: range) -> str:
    return f"{heads.start}..{heads.stop - 1}"


def layout_mismatch(expected: KVLayout, actual: KVLayout, fields: tuple[str, ...] = LAYOUT_FIELDS) -> str | None:
    """Name of the first of `fields` where two layouts differ, or None when equal."""
    for name in fields:
        if getattr(expected, name) != getattr(actual, name):
            return name
    return None


def require_same_layout(expected: KVLayout, actual: KVLayout, what: str = "layout") -> None:
    """Raise FailedPrecondition naming the first differing field (the heads held included)."""
    name = layout_mismatch(expected, actual)
    if name is None and expected.model_kv_heads != actual.model_kv_heads:
        name = "total_kv_heads"
    if name is None and expected.heads != actual.heads:
        name = "kv_head_start"
    if name is not None:
        raise FailedPrecondition(
            f"KV layouts differ in {name}: {getattr(expected, name)!r} here, "
            f"{getattr(actual, name)!r} offered; KV moves only between equal layouts{_FIXES.get(name, '')}",
            field=f"{what}.{name}",
        )


def check_layout(layout: KVLayout, cache: torch.Tensor) -> None:
    """Raise FailedPrecondition unless `cache` has the shape and dtype `layout` describes."""
    require_same_layout(layout, layout_of(cache, layout.model_id, layout.hash_namespace, layout.kv_head_start,
                                          layout.total_kv_heads))
