"""The disk tier's files are checksummed, written and read on its I/O thread, never on the
event loop, and a block whose file is not written yet is still served."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import torch

import services.kvstore.disk as disk
from services.kvstore.store import StoreConfig
from tests.services.kvstore.test_store import BLOCK_BYTES, Store, chain


async def test_checksums_run_on_the_io_thread(tmp_path: Path, monkeypatch):
    threads = []
    digest = disk._digest

    def recording(block_hash, payload):  # type: ignore[no-untyped-def]
        threads.append(threading.current_thread().name)
        return digest(block_hash, payload)

    monkeypatch.setattr(disk, "_digest", recording)
    config = StoreConfig(ram_bytes=BLOCK_BYTES, disk_path=tmp_path, disk_bytes=1 << 20)
    hashes, blocks = chain(4, seed=6)
    async with Store(config) as store:
        await store.client.put(hashes, blocks)  # every block written to disk: 4 writes
        assert len(threads) == 4
        # RAM holds block 3 only: 3 reads, and no writes (the files are there already)
        assert torch.equal(await store.client.get(hashes[:3]), blocks[:3])
        await store.backend._disk.flush()
        assert len(threads) == 7 and all(name.startswith("kvstore-disk") for name in threads)


async def test_unwritten_blocks_are_served_from_memory(tmp_path: Path):
    config = StoreConfig(ram_bytes=BLOCK_BYTES // 2, disk_path=tmp_path, disk_bytes=1 << 20)
    hashes, blocks = chain(3, seed=7)
    async with Store(config) as store:
        release = threading.Event()
        store.backend._disk._io.submit(release.wait)  # the I/O thread is busy until released
        try:
            put = asyncio.ensure_future(store.client.put(hashes, blocks))
            await _wait_until(lambda: len(store.backend._disk) == 3)  # indexed, not written
            assert list(tmp_path.glob("blocks/*/*.kvb")) == []
            assert await store.client.lookup(hashes) == 3
            assert torch.equal(await store.client.get(hashes[:2]), blocks[:2])
            stats = await store.client.stats()
            assert (stats.num_blocks_ram, stats.num_blocks_disk, stats.bytes_stored) == (0, 3, 3 * BLOCK_BYTES)
            assert not put.done()  # the acknowledgement waits for the files
        finally:
            release.set()
        assert (await put).num_stored == 3
        names = sorted(path.name for path in tmp_path.glob("blocks/*/*.kvb"))
        assert names == sorted(h.hex() + disk.SUFFIX for h in hashes)  # on disk once acknowledged
    async with Store(config) as store:
        assert torch.equal(await store.client.get(hashes), blocks)


async def _wait_until(condition, timeout_s: float = 5.0) -> None:  # type: ignore[no-untyped-def]
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)


async def test_throttle_waits_while_too_much_is_queued(tmp_path: Path):
    tier = disk.DiskTier(tmp_path, capacity_bytes=1 << 20, max_unwritten_bytes=200)
    tier.open()
    release = threading.Event()
    tier._io.submit(release.wait)
    tier.put(b"a", b"x" * 100)
    tier.put(b"b", b"y" * 100)
    await asyncio.wait_for(tier.throttle(), timeout=5)  # 200 bytes queued: at the limit, no wait
    tier.put(b"c", b"z" * 100)
    waiting = asyncio.ensure_future(tier.throttle())
    await asyncio.sleep(0.05)
    assert not waiting.done() and tier.num_unwritten_bytes == 300
    release.set()
    await asyncio.wait_for(waiting, timeout=5)
    assert tier.num_unwritten_bytes == 0
    assert sorted(path.name for path in tmp_path.glob("blocks/*/*.kvb")) == [b"a".hex() + ".kvb", b"b".hex() + ".kvb", b"c".hex() + ".kvb"]
    assert await tier.get(b"b") == b"y" * 100  # read back from its file
    await tier.close()
