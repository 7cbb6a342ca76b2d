"""What the kvstore servicer hands work to.

Blocks are addressed by chained hashes; a layout id (from `connect`) scopes them to one KV
layout. The RAM + disk LRU store (`services.kvstore.store.BlockStore`) implements it.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Protocol

from cleave.rpc.types import KVLayout, TensorBytes


@dataclass(frozen=True)
class KVBlock:
    """One stored block: K and V of block_size tokens for every layer."""

    hash: bytes
    parent_hash: bytes  # b"" for the first block of a chain
    layout_id: str
    payload: TensorBytes  # [num_layers, 2, block_size, num_kv_heads, head_dim]; data may be a memoryview


@dataclass(frozen=True)
class ConnectResult:
    """The id of a registered layout."""

    layout_id: str
    block_num_bytes: int


@dataclass(frozen=True)
class PutResult:
    """Outcome of one Put stream."""

    num_stored: int
    num_already_present: int


@dataclass(frozen=True)
class StoreStats:
    """Counters since the store started."""

    hits: int = 0
    misses: int = 0
    bytes_stored: int = 0
    bytes_served: int = 0
    evictions: int = 0
    num_blocks_ram: int = 0
    num_blocks_disk: int = 0
    num_bytes_ram: int = 0
    num_bytes_disk: int = 0
    checksum_failures: int = 0  # corrupt disk files dropped
    num_lookups: int = 0  # Lookup calls answered


@dataclass(frozen=True)
class BlockEvent:
    """Part of a watch's snapshot, or one change to the set of stored blocks.

    A watcher's index is the snapshot's hashes with the later events applied in order; an
    event holds stored or removed hashes, never both."""

    stored: tuple[bytes, ...] = ()
    removed: tuple[bytes, ...] = ()
    snapshot_done: bool = False  # the last part of the snapshot


class KVStoreBackend(Protocol):
    """A KV block store."""

    async def start(self) -> None:
        """Open the disk tier."""

    async def shutdown(self) -> None:
        """Flush and close the disk tier."""

    async def connect(self, layout: KVLayout, client_id: str) -> ConnectResult:
        """Register a layout; equal layouts get equal ids."""

    async def lookup(self, layout_id: str, block_hashes: tuple[bytes, ...]) -> int:
        """Length of the longest stored prefix of block_hashes."""

    async def put(self, blocks: AsyncIterator[KVBlock]) -> PutResult:
        """Store blocks (already-present ones are skipped)."""

    def get(self, layout_id: str, block_hashes: tuple[bytes, ...]) -> AsyncIterator[KVBlock]:
        """The stored prefix of a chain, in order, stopping at the first miss."""

    def stats(self) -> StoreStats:
        """Current counters."""

    def watch(self, layout_id: str) -> AsyncIterator[BlockEvent]:
        """The layout's stored hashes (a snapshot, in parts), then every change as it happens.
        Ends when the store shuts down; raises ResourceExhausted when the watcher falls behind."""
