"""The KV block store and its disk tier at their edges: what the disk tier evicts leaves RAM with
its bytes, a block of exactly the disk's capacity, LRU refreshes by Get and Lookup, watchers told
the truth about a block evicted and stored again in one Put, misses and removals from corrupt
files, and the disk tier's index, unwritten-byte count and files when a read, a verify or a write
races a removal."""

from __future__ import annotations

import asyncio
import os
import threading
from pathlib import Path

import pytest
import torch

import services.kvstore.disk as disk
from cleave.proto.cleave.v1 import common_pb2 as c, kvstore_pb2 as k
from cleave.rpc.types import TensorBytes
from services.kvstore.backend import KVBlock
from services.kvstore.store import StoreConfig, block_shape
from tests.services.kvstore.test_store import BLOCK_BYTES, LAYOUT, Store, chain
from tests.services.kvstore.test_watch import read, snapshot, watch_call

EVENT_TIMEOUT_S = 5.0


def _corrupt(directory: Path, block_hash: bytes) -> Path:
    """Flip one payload bit of a block's file (same length: only the checksum can tell)."""
    path = next(directory.glob(f"blocks/*/{block_hash.hex()}{disk.SUFFIX}"))
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01
    path.write_bytes(bytes(data))
    return path


class GatedReads:
    """Holds the disk tier's next file read on its I/O thread until `release`; `reading` is
    set once the read has started."""

    def __init__(self, tier: disk.DiskTier, monkeypatch: pytest.MonkeyPatch) -> None:
        self.loop = asyncio.get_running_loop()
        self.reading = asyncio.Event()
        self._release = threading.Event()
        read_file = tier._read_file

        def gated(block_hash: bytes):  # type: ignore[no-untyped-def]
            self.loop.call_soon_threadsafe(self.reading.set)
            self._release.wait()
            return read_file(block_hash)

        monkeypatch.setattr(tier, "_read_file", gated)

    async def started(self) -> None:
        await asyncio.wait_for(self.reading.wait(), EVENT_TIMEOUT_S)

    def release(self) -> None:
        self._release.set()


async def _written_tier(directory: Path, blocks: dict[bytes, bytes]) -> None:
    """A closed disk tier holding `blocks` in files (reopened, they are unverified)."""
    tier = disk.DiskTier(directory, capacity_bytes=1 << 20)
    tier.open()
    for block_hash, payload in blocks.items():
        tier.put(block_hash, payload)
    await tier.close()


# -- the store: tiers and their byte counts -----------------------------------------------------

async def test_a_block_the_disk_tier_evicts_leaves_ram_and_its_bytes_with_it(tmp_path: Path):
    config = StoreConfig(ram_bytes=1 << 20, disk_path=tmp_path, disk_bytes=2 * BLOCK_BYTES)
    hashes, blocks = chain(3, seed=21)
    async with Store(config) as store:
        await store.client.put(hashes, blocks)  # room for two on disk: block 0 goes, from RAM too
        stats = store.backend.stats()  # the client's Stats leaves the RAM tier's bytes out
        assert (stats.num_blocks_ram, stats.num_bytes_ram, stats.evictions) == (2, 2 * BLOCK_BYTES, 1)
        assert await store.client.lookup(hashes[:1]) == 0
        assert await store.client.lookup(hashes[1:]) == 2


async def test_a_block_larger_than_the_disk_tier_is_kept_in_neither_tier(tmp_path: Path):
    config = StoreConfig(ram_bytes=1 << 20, disk_path=tmp_path, disk_bytes=BLOCK_BYTES - 1)
    hashes, blocks = chain(1, seed=22)
    async with Store(config) as store:
        await store.client.put(hashes, blocks)
        assert await store.client.lookup(hashes) == 0
        stats = store.backend.stats()
        assert (stats.num_blocks_ram, stats.num_bytes_ram, stats.num_blocks_disk) == (0, 0, 0)


async def test_a_block_of_exactly_the_disk_capacity_is_stored(tmp_path: Path):
    config = StoreConfig(ram_bytes=BLOCK_BYTES // 2, disk_path=tmp_path, disk_bytes=BLOCK_BYTES)
    hashes, blocks = chain(2, seed=23)
    async with Store(config) as store:
        await store.client.put(hashes[:1], blocks[:1])
        assert await store.client.lookup(hashes[:1]) == 1
        await store.client.put(hashes[1:], blocks[1:], parent_hash=hashes[0])  # replaces it
        assert [await store.client.lookup([h]) for h in hashes] == [0, 1]


async def test_shutdown_empties_the_ram_tier_and_its_byte_count(tmp_path: Path):
    config = StoreConfig(ram_bytes=1 << 20, disk_path=tmp_path, disk_bytes=1 << 20)
    hashes, blocks = chain(2, seed=24)
    async with Store(config) as store:
        await store.client.put(hashes, blocks)
    stats = store.backend.stats()
    assert (stats.num_blocks_ram, stats.num_bytes_ram, stats.num_blocks_disk) == (0, 0, 2)


# -- the store: LRU refreshes ----------------------------------------------------------------------

async def test_a_get_refreshes_a_ram_block_so_the_next_eviction_spares_it():
    async with Store(StoreConfig(ram_bytes=2 * BLOCK_BYTES)) as store:  # RAM only
        hashes, blocks = chain(3, seed=25)
        await store.client.put(hashes[:2], blocks[:2])
        assert torch.equal(await store.client.get(hashes[:1]), blocks[:1])  # block 0 the most recent
        await store.client.put(hashes[2:], blocks[2:], parent_hash=hashes[1])  # evicts block 1
        assert [await store.client.lookup([h]) for h in hashes] == [1, 0, 1]


async def test_a_lookup_refreshes_a_disk_block_so_the_next_eviction_spares_it(tmp_path: Path):
    config = StoreConfig(ram_bytes=BLOCK_BYTES // 2, disk_path=tmp_path, disk_bytes=2 * BLOCK_BYTES)
    hashes, blocks = chain(3, seed=26)
    async with Store(config) as store:
        await store.client.put(hashes[:2], blocks[:2])
        assert await store.client.lookup(hashes[:1]) == 1  # block 0 the most recent on disk
        await store.client.put(hashes[2:], blocks[2:], parent_hash=hashes[1])  # evicts block 1
        assert [await store.client.lookup([h]) for h in hashes] == [1, 0, 1]


# -- the store: corrupt files, counters and watchers -----------------------------------------------

async def _chain_with_corrupt_middle(tmp_path: Path, seed: int) -> tuple[StoreConfig, list, torch.Tensor]:
    """Three blocks put on disk by one store, the middle one's file then corrupted: the config
    a second store opens them with, the hashes and the blocks."""
    config = StoreConfig(ram_bytes=BLOCK_BYTES // 2, disk_path=tmp_path, disk_bytes=1 << 20)
    hashes, blocks = chain(3, seed=seed)
    async with Store(config) as store:
        await store.client.put(hashes, blocks)
    _corrupt(tmp_path, hashes[1])
    return config, hashes, blocks


async def test_a_corrupt_file_found_by_lookup_counts_the_rest_of_the_chain_as_misses(tmp_path: Path):
    config, hashes, _ = await _chain_with_corrupt_middle(tmp_path, seed=27)
    async with Store(config) as store:
        assert await store.client.lookup(hashes) == 1
        stats = await store.client.stats()
        assert (stats.hits, stats.misses) == (1, 2)


async def test_a_corrupt_file_found_by_get_is_published_as_removed(tmp_path: Path):
    config, hashes, blocks = await _chain_with_corrupt_middle(tmp_path, seed=28)
    async with Store(config) as store:
        call = watch_call(store)
        try:
            assert sorted(await snapshot(call)) == sorted(hashes)
            got = await store.client.get(hashes)
            assert got.shape[0] == 1 and torch.equal(got[0], blocks[0])
            event = await read(call)
            assert (list(event.stored_hashes), list(event.removed_hashes)) == ([], hashes[1:2])
        finally:
            call.cancel()


async def test_a_block_evicted_and_stored_again_in_one_put_is_not_published_as_removed():
    async with Store(StoreConfig(ram_bytes=2 * BLOCK_BYTES)) as store:  # RAM only
        hashes, _ = chain(3, seed=29)
        payload = c.Tensor(dtype=c.DTYPE_FLOAT32, shape=list(block_shape(LAYOUT)), data=bytes(BLOCK_BYTES))
        call = watch_call(store)
        try:
            assert await snapshot(call) == []
            # 0, 1; 2 evicts 0; 0 again evicts 1: the store ends with 2 and 0
            order = [hashes[0], hashes[1], hashes[2], hashes[0]]
            await store.stub.Put(iter([k.KVBlock(hash=h, layout_id=store.client.layout_id, payload=payload)
                                       for h in order]))
            stored, removed = await read(call), await read(call)
            assert set(stored.stored_hashes) == {hashes[0], hashes[2]} and not stored.removed_hashes
            assert (list(removed.stored_hashes), list(removed.removed_hashes)) == ([], hashes[1:2])
            assert [await store.client.lookup([h]) for h in hashes] == [1, 0, 1]
        finally:
            call.cancel()


async def test_a_block_evicted_from_disk_while_its_file_is_read_is_served_but_not_cached(
        tmp_path: Path, monkeypatch):
    config = StoreConfig(ram_bytes=BLOCK_BYTES, disk_path=tmp_path, disk_bytes=2 * BLOCK_BYTES)
    hashes, blocks = chain(3, seed=30)
    async with Store(config) as store:
        await store.client.put(hashes[:2], blocks[:2])  # RAM holds block 1; the disk both
        reads = GatedReads(store.backend._disk, monkeypatch)
        get = asyncio.ensure_future(store.client.get(hashes[:1]))  # block 0 from its file
        await reads.started()
        put_done = asyncio.Event()

        async def third_block():  # type: ignore[no-untyped-def]
            yield KVBlock(hash=hashes[2], parent_hash=hashes[1], layout_id=store.client.layout_id,
                          payload=TensorBytes(LAYOUT.dtype, block_shape(LAYOUT), blocks[2].numpy().tobytes()))
            put_done.set()  # asked for the next block: the third is indexed, block 0 evicted

        put = asyncio.ensure_future(store.backend.put(third_block()))
        try:
            await asyncio.wait_for(put_done.wait(), EVENT_TIMEOUT_S)
        finally:
            reads.release()
        assert (await put).num_stored == 1
        assert torch.equal(await get, blocks[:1])  # what was read is still the block's content
        assert await store.client.lookup(hashes[:1]) == 0  # but it is not stored any more
        stats = await store.client.stats()
        assert (stats.num_blocks_ram, stats.num_blocks_disk) == (1, 2)


# -- the disk tier -------------------------------------------------------------------------------

async def test_putting_an_indexed_block_again_refreshes_it_on_disk(tmp_path: Path):
    tier = disk.DiskTier(tmp_path, capacity_bytes=200)
    tier.open()
    try:
        assert tier.put(b"a", b"x" * 100) == [] and tier.put(b"b", b"y" * 100) == []
        assert tier.put(b"a", b"x" * 100) == []  # already there: now the most recent
        assert tier.put(b"c", b"z" * 100) == [b"b"]
        assert tier.hashes() == [b"a", b"c"]
    finally:
        await tier.close()


async def test_removing_a_block_before_its_file_is_written_forgets_its_unwritten_bytes(tmp_path: Path):
    tier = disk.DiskTier(tmp_path, capacity_bytes=1 << 20)
    tier.open()
    release = threading.Event()
    tier._io.submit(release.wait)  # the I/O thread is busy until released
    try:
        tier.put(b"a", b"x" * 100)
        tier.remove(b"a")
        assert tier.num_unwritten_bytes == 0 and tier.num_bytes == 0
    finally:
        release.set()
    await tier.flush()
    assert tier.num_unwritten_bytes == 0
    assert list(tmp_path.glob(f"blocks/*/*{disk.SUFFIX}")) == []  # written, then deleted
    await tier.close()


async def test_an_earlier_write_of_a_block_put_again_leaves_the_new_payload_counted(tmp_path: Path):
    tier = disk.DiskTier(tmp_path, capacity_bytes=1 << 20)
    tier.open()
    first_gate, second_gate, between = threading.Event(), threading.Event(), threading.Event()
    tier._io.submit(first_gate.wait)
    try:
        # two buffers of the same content, as two Puts deliver them (not one folded constant)
        tier.put(b"a", memoryview(bytearray(b"x" * 100)))  # first write queued
        tier.remove(b"a")
        tier._io.submit(lambda: (between.set(), second_gate.wait()))
        tier.put(b"a", memoryview(bytearray(b"x" * 100)))  # the second write, behind the second gate
        first_gate.set()
        assert await asyncio.to_thread(between.wait, EVENT_TIMEOUT_S)  # first write and delete done
        assert tier.num_unwritten_bytes == 100  # the second write is still to come
    finally:
        first_gate.set()
        second_gate.set()
    await tier.flush()
    assert tier.num_unwritten_bytes == 0 and await tier.get(b"a") == b"x" * 100
    await tier.close()


async def test_a_corrupt_read_of_a_block_put_again_meanwhile_keeps_the_new_block(tmp_path: Path, monkeypatch):
    await _written_tier(tmp_path, {b"a": b"x" * 100})
    _corrupt(tmp_path, b"a")
    tier = disk.DiskTier(tmp_path, capacity_bytes=1 << 20)
    tier.open()
    reads = GatedReads(tier, monkeypatch)
    get = asyncio.ensure_future(tier.get(b"a"))
    try:
        await reads.started()
        tier.remove(b"a")
        tier.put(b"a", b"x" * 100)  # put again while the corrupt file is read
    finally:
        reads.release()
    assert await get is None
    assert b"a" in tier and tier.num_bytes == 100
    await tier.flush()
    assert await tier.get(b"a") == b"x" * 100
    await tier.close()


async def test_a_block_removed_while_its_file_is_verified_is_not_reported_or_forgotten_twice(
        tmp_path: Path, monkeypatch):
    await _written_tier(tmp_path, {b"a": b"x" * 100, b"b": b"y" * 100})
    _corrupt(tmp_path, b"a")
    tier = disk.DiskTier(tmp_path, capacity_bytes=1 << 20)
    tier.open()
    reads = GatedReads(tier, monkeypatch)
    verify = asyncio.ensure_future(tier.verify([b"a", b"b"]))
    try:
        await reads.started()
        tier.remove(b"a")
        tier.remove(b"b")
    finally:
        reads.release()
    assert await verify == set()
    assert len(tier) == 0 and tier.num_bytes == 0
    assert not tier.is_verified(b"a") and not tier.is_verified(b"b")
    await tier.close()


async def test_a_read_from_disk_verifies_the_block(tmp_path: Path):
    await _written_tier(tmp_path, {b"a": b"x" * 100})
    tier = disk.DiskTier(tmp_path, capacity_bytes=1 << 20)
    tier.open()
    assert not tier.is_verified(b"a")  # found at open: only its length was checked
    assert await tier.get(b"a") == b"x" * 100
    assert tier.is_verified(b"a")
    await tier.close()


async def test_a_block_file_under_another_blocks_name_is_dropped_at_open(tmp_path: Path):
    await _written_tier(tmp_path, {b"a": b"x" * 100})
    (original,) = tmp_path.glob(f"blocks/*/*{disk.SUFFIX}")
    impostor = tmp_path / "blocks" / b"b".hex() / f"{b'b'.hex()}{disk.SUFFIX}"
    impostor.parent.mkdir()
    impostor.write_bytes(original.read_bytes())
    tier = disk.DiskTier(tmp_path, capacity_bytes=1 << 20)
    tier.open()
    assert tier.hashes() == [b"a"] and tier.num_bytes == 100
    assert not impostor.exists() and original.exists()
    await tier.close()


async def test_open_orders_the_index_by_each_files_last_access(tmp_path: Path):
    payloads = {bytes([n]) * 4: bytes([n]) * 100 for n in range(6)}
    await _written_tier(tmp_path, payloads)
    listed = list(tmp_path.glob(f"blocks/*/*{disk.SUFFIX}"))  # the order open will find them in
    oldest_first = list(reversed(listed))
    for age, path in enumerate(oldest_first):
        stamp = 1_700_000_000_000_000_000 + age * 1_000_000_000
        os.utime(path, ns=(stamp, stamp))
    tier = disk.DiskTier(tmp_path, capacity_bytes=1 << 20)
    tier.open()
    assert tier.hashes() == [bytes.fromhex(path.name.removesuffix(disk.SUFFIX)) for path in oldest_first]
    await tier.close()


async def test_open_deletes_temporary_files_of_writes_that_never_finished(tmp_path: Path):
    await _written_tier(tmp_path, {b"a": b"x" * 100})
    (original,) = tmp_path.glob(f"blocks/*/*{disk.SUFFIX}")
    unfinished = original.with_name(f".{b'c'.hex()}{disk.SUFFIX}.tmp")
    unfinished.write_bytes(b"half a block")
    tier = disk.DiskTier(tmp_path, capacity_bytes=1 << 20)
    tier.open()
    assert not unfinished.exists() and tier.hashes() == [b"a"]
    await tier.close()


async def test_a_new_block_directory_is_made_durable_in_its_parent(tmp_path: Path, monkeypatch):
    synced: list[Path] = []
    fsync_directory = disk._fsync_directory
    monkeypatch.setattr(disk, "_fsync_directory", lambda path: (synced.append(Path(path)), fsync_directory(path)))
    tier = disk.DiskTier(tmp_path, capacity_bytes=1 << 20)
    tier.open()
    synced.clear()
    tier.put(b"a", b"x" * 100)  # its file goes into a new blocks/61/
    await tier.sync()
    assert set(synced) == {tmp_path / "blocks", tmp_path / "blocks" / b"a".hex()}
    await tier.close()
