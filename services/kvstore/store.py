"""The KV block store behind the KVStore service: one layout, a RAM LRU tier, a disk LRU tier.

Blocks are keyed by their chained prefix hash (`cleave.kv.prefix_hash`); a payload is all
layers' K and V of one block, `[num_layers, 2, block_size, num_kv_heads, head_dim]` raw bytes
of the layout's dtype. The store serves exactly one KV layout (the first one connected, or
the one its disk tier was written with): blocks of different models, dtypes or shapes are
never mixed.

Without a disk tier the store is RAM only, an LRU cache: a Put is acknowledged once its
blocks are in memory, and a restart loses them. With a disk tier the disk holds every block
and the RAM tier caches the recently used ones (a subset): a Put is acknowledged only after
each new block's file is written and fsynced and the directories are synced
(`DiskTier.sync`, once per Put), so an acknowledged block survives a crash; the disk tier's
capacity is the store's, and a block it evicts leaves RAM too. A disk hit is copied into RAM,
its file stays. Lookup never counts a block whose file it has not verified: a corrupt file
found there is a miss and is deleted.

A stored payload is the buffer the block arrived in (a view of the Put message gRPC
delivered, or of a disk file read), never copied on the event loop; disk files are written and
read on the disk tier's I/O thread.

Watchers (`watch`, services/kvstore/watch.py) follow the set of stored hashes: a Put
publishes the hashes it newly stored once they are kept, and the hashes it evicted; a corrupt
file found by Lookup or Get publishes its removal. Each publish says what is true when it is
made (stored hashes still present, removed ones still absent), so a block evicted and stored
again while a Put runs ends up right in every watcher's index.
"""

from __future__ import annotations

import asyncio
import hashlib
import math
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass
from pathlib import Path

import structlog

from cleave.errors import FailedPrecondition, InvalidArgument, NotFound
from cleave.rpc.convert import DTYPE_ITEMSIZE
from cleave.rpc.types import KVLayout, TensorBytes
from services.kvstore.backend import BlockEvent, ConnectResult, KVBlock, PutResult, StoreStats
from services.kvstore.disk import Buffer, DiskTier
from services.kvstore.watch import WATCH_QUEUE_HASHES, WatchHub

_LAYOUT_FIELDS = ("model_id", "dtype", "block_size", "num_layers", "num_kv_heads", "head_dim", "hash_namespace")


@dataclass(frozen=True)
class StoreConfig:
    """Capacities of the tiers; no disk_path means RAM only."""

    ram_bytes: int
    disk_path: Path | None = None
    disk_bytes: int = 0
    watch_queue_hashes: int = WATCH_QUEUE_HASHES  # a watcher further behind is ended


def layout_id(layout: KVLayout) -> str:
    """Stable id of a layout: equal layouts, equal ids, in every process."""
    canonical = "\n".join(f"{name}={getattr(layout, name)}" for name in _LAYOUT_FIELDS)
    return hashlib.sha256(canonical.encode()).hexdigest()[:32]


def block_shape(layout: KVLayout) -> tuple[int, ...]:
    """[num_layers, 2, block_size, num_kv_heads, head_dim]"""
    return (layout.num_layers, 2, layout.block_size, layout.num_kv_heads, layout.head_dim)


@dataclass
class _Counters:
    hits: int = 0
    misses: int = 0
    bytes_served: int = 0
    evictions: int = 0
    lookups: int = 0


class BlockStore:
    """Content-addressed KV blocks in RAM and (optionally) on disk; a KVStoreBackend."""

    def __init__(self, config: StoreConfig) -> None:
        self.config = config
        self._ram: OrderedDict[bytes, Buffer] = OrderedDict()  # hash -> payload, LRU first
        self._ram_bytes = 0
        self._disk = DiskTier(config.disk_path, config.disk_bytes) if config.disk_path else None
        self._layout: KVLayout | None = None
        self._layout_id = ""
        self._counters = _Counters()
        self._watchers = WatchHub(config.watch_queue_hashes)
        self.log = structlog.get_logger("cleave.kvstore")

    # -- lifecycle --------------------------------------------------------------------------

    async def start(self) -> None:
        if self._disk is not None:
            stored = await asyncio.to_thread(self._disk.read_layout)  # before open: it may move blocks aside
            await asyncio.to_thread(self._disk.open)
            if stored is not None:
                self._set_layout(stored)
            self.log.info("disk tier opened", blocks=len(self._disk), bytes=self._disk.num_bytes)

    async def drain(self) -> None:
        """End the watchers' streams (they would hold the server's stop for its whole grace
        period) and refuse new ones; every other call goes on until the server stops."""
        self._watchers.close()

    async def shutdown(self) -> None:
        """Finish the disk tier's writes (every block is on disk already: RAM is its cache)."""
        self._watchers.close()
        if self._disk is None:
            return
        self._ram.clear()
        self._ram_bytes = 0
        await self._disk.close()

    # -- layout -----------------------------------------------------------------------------

    def _set_layout(self, layout: KVLayout) -> None:
        self._layout, self._layout_id = layout, layout_id(layout)

    @property
    def block_num_bytes(self) -> int:
        assert self._layout is not None
        return math.prod(block_shape(self._layout)) * DTYPE_ITEMSIZE[self._layout.dtype]

    async def connect(self, layout: KVLayout, client_id: str) -> ConnectResult:
        if self._layout is None:
            self._set_layout(layout)
            if self._disk is not None:
                self._disk.write_layout(layout)
            self.log.info("layout set", client_id=client_id, **asdict(layout))
        for name in _LAYOUT_FIELDS:
            mine, theirs = getattr(self._layout, name), getattr(layout, name)
            if mine != theirs:
                raise FailedPrecondition(
                    f"this store holds {name}={mine!r}, the client has {theirs!r}; "
                    "run one kvstore per KV layout", field=f"layout.{name}")
        return ConnectResult(layout_id=self._layout_id, block_num_bytes=self.block_num_bytes)

    def _require_layout(self, value: str, field: str = "layout_id") -> KVLayout:
        if self._layout is None or value != self._layout_id:
            raise NotFound(f"unknown layout id {value!r}; call Connect first", field=field)
        return self._layout

    # -- tiers ------------------------------------------------------------------------------

    def _contains(self, block_hash: bytes) -> bool:
        """Whether the block is stored (its disk file possibly not verified yet); refreshes it."""
        in_disk = self._disk is not None and block_hash in self._disk
        if in_disk:
            self._disk.touch(block_hash)  # type: ignore[union-attr]
        if block_hash in self._ram:
            self._ram.move_to_end(block_hash)
            return True
        return in_disk

    def _is_stored(self, block_hash: bytes) -> bool:
        """Whether the block is in a tier (without refreshing it)."""
        return block_hash in self._ram or (self._disk is not None and block_hash in self._disk)

    def _insert_ram(self, block_hash: bytes, payload: Buffer) -> list[bytes]:
        """Cache a block in RAM; without a disk tier what falls out of RAM is evicted (returned)."""
        self._ram[block_hash] = payload
        self._ram_bytes += len(payload)
        evicted = []
        while self._ram_bytes > self.config.ram_bytes and self._ram:
            oldest, data = self._ram.popitem(last=False)
            self._ram_bytes -= len(data)
            if self._disk is None:
                self._counters.evictions += 1
                evicted.append(oldest)
        return evicted

    def _drop_ram(self, block_hash: bytes) -> None:
        data = self._ram.pop(block_hash, None)
        if data is not None:
            self._ram_bytes -= len(data)

    def _store(self, block_hash: bytes, payload: Buffer) -> list[bytes]:
        """A new block: on disk (queued; `DiskTier.sync` makes it durable) and cached in RAM.
        Returns the hashes evicted from the store to make room."""
        if self._disk is not None:
            evicted = self._disk.put(block_hash, payload)
            for oldest in evicted:
                self._drop_ram(oldest)
            self._counters.evictions += len(evicted)
            if block_hash in evicted:
                return evicted  # larger than the disk tier: not stored
            self._insert_ram(block_hash, payload)  # what falls out of RAM stays on disk
            return evicted
        return self._insert_ram(block_hash, payload)

    def _publish(self, stored: list[bytes], removed: list[bytes]) -> None:
        """Tell the watchers what is true now of these hashes (see the module docstring)."""
        self._watchers.publish([h for h in stored if self._is_stored(h)],
                               [h for h in removed if not self._is_stored(h)])

    async def _verified_prefix(self, block_hashes: tuple[bytes, ...]) -> int:
        """How many of these stored blocks lead the chain with their files verified (a corrupt
        file found here is deleted, and its block dropped from the store)."""
        if self._disk is None:
            return len(block_hashes)
        unverified = [h for h in block_hashes if h not in self._ram and not self._disk.is_verified(h)]
        corrupt = await self._disk.verify(unverified) if unverified else set()
        if corrupt:
            self._publish([], list(corrupt))
        for position, block_hash in enumerate(block_hashes):
            if block_hash in corrupt or not self._contains(block_hash):
                return position
        return len(block_hashes)

    async def _read(self, block_hash: bytes) -> Buffer | None:
        payload = self._ram.get(block_hash)
        if payload is not None:
            self._ram.move_to_end(block_hash)
            if self._disk is not None and block_hash in self._disk:
                self._disk.touch(block_hash)
            return payload
        if self._disk is None:
            return None
        was_stored = block_hash in self._disk
        payload = await self._disk.get(block_hash)
        if payload is None:
            if was_stored:  # a corrupt file, dropped (unless stored again meanwhile)
                self._publish([], [block_hash])
            return None
        promoted = self._ram.get(block_hash)  # by another call while the file was read
        if promoted is not None:
            self._ram.move_to_end(block_hash)
            return promoted
        if block_hash in self._disk:  # not evicted while it was read
            self._insert_ram(block_hash, payload)
        return payload

    # -- API --------------------------------------------------------------------------------

    async def lookup(self, layout_id: str, block_hashes: tuple[bytes, ...]) -> int:
        self._require_layout(layout_id)
        self._counters.lookups += 1
        num_present = 0
        for block_hash in block_hashes:
            if not self._contains(block_hash):
                break
            num_present += 1
        num_hit = await self._verified_prefix(block_hashes[:num_present])
        self._counters.hits += num_hit
        self._counters.misses += len(block_hashes) - num_hit
        return num_hit

    async def put(self, blocks: AsyncIterator[KVBlock]) -> PutResult:
        num_stored = num_present = 0
        position = 0
        stored: list[bytes] = []  # told to the watchers once kept (also when the stream fails)
        removed: list[bytes] = []
        try:
            async for block in blocks:
                layout = self._require_layout(block.layout_id, f"blocks[{position}].layout_id")
                payload = block.payload
                if payload.dtype != layout.dtype or tuple(payload.shape) != block_shape(layout):
                    raise InvalidArgument(
                        f"payload is {payload.dtype} {list(payload.shape)}, the layout needs "
                        f"{layout.dtype} {list(block_shape(layout))}", field=f"blocks[{position}].payload")
                if self._contains(block.hash):
                    num_present += 1
                else:
                    removed += self._store(block.hash, payload.data)  # the received buffer, not a copy
                    stored.append(block.hash)
                    num_stored += 1
                    if self._disk is not None:
                        await self._disk.throttle()
                position += 1
            if self._disk is not None:
                await self._disk.sync()  # the acknowledgement promises the blocks are on disk
        finally:
            self._publish(stored, removed)
        return PutResult(num_stored=num_stored, num_already_present=num_present)

    async def get(self, layout_id: str, block_hashes: tuple[bytes, ...]) -> AsyncIterator[KVBlock]:
        layout = self._require_layout(layout_id)
        shape = block_shape(layout)
        parent = b""
        for position, block_hash in enumerate(block_hashes):
            payload = await self._read(block_hash)
            if payload is None:
                self._counters.misses += len(block_hashes) - position
                return
            self._counters.hits += 1
            self._counters.bytes_served += len(payload)
            yield KVBlock(hash=block_hash, parent_hash=parent, layout_id=layout_id,
                          payload=TensorBytes(layout.dtype, shape, payload))
            parent = block_hash
            await asyncio.sleep(0)  # let other calls (and cancellation) in between blocks

    def stats(self) -> StoreStats:
        disk_blocks = len(self._disk) if self._disk is not None else 0
        disk_bytes = self._disk.num_bytes if self._disk is not None else 0
        return StoreStats(
            hits=self._counters.hits, misses=self._counters.misses,
            bytes_stored=disk_bytes if self._disk is not None else self._ram_bytes, bytes_served=self._counters.bytes_served,
            evictions=self._counters.evictions, num_blocks_ram=len(self._ram),
            num_blocks_disk=disk_blocks, num_bytes_ram=self._ram_bytes, num_bytes_disk=disk_bytes,
            checksum_failures=self._disk.num_corrupt_files if self._disk is not None else 0,
            num_lookups=self._counters.lookups,
        )

    async def watch(self, layout_id: str) -> AsyncIterator[BlockEvent]:
        self._require_layout(layout_id)
        # the snapshot and the subscription with no await between them: no change falls between
        snapshot = list(self._disk.hashes()) if self._disk is not None else []
        snapshot += [h for h in self._ram if self._disk is None or h not in self._disk]
        watcher = self._watchers.subscribe(snapshot)
        try:
            async for event in watcher.events():
                yield event
        finally:
            watcher.end()
