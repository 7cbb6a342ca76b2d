"""KVStore service over real gRPC: layouts, put/lookup/get, LRU tiers, disk restarts, counters."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path

import grpc
import pytest
import torch

from cleave.kv.prefix_hash import block_hashes
from cleave.proto.cleave.v1 import common_pb2 as c, kvstore_pb2 as k, kvstore_pb2_grpc
from cleave.rpc import serve
from cleave.rpc.types import KVLayout
from cleave.transfer.kvstore_client import KVStoreClient, gather_blocks, scatter_blocks
from services.kvstore.__main__ import registration
from services.kvstore.servicer import KVStoreServicer
from services.kvstore.store import BlockStore, StoreConfig

LAYOUT = KVLayout(model_id="tiny", dtype="float32", block_size=4, num_layers=2, num_kv_heads=2, head_dim=4)
BLOCK_BYTES = 2 * 2 * 4 * 2 * 4 * 4  # [L, 2, BS, Hkv, D] fp32 = 512


class Store:
    """A BlockStore served in-process on an ephemeral port, with a connected client."""

    def __init__(self, config: StoreConfig) -> None:
        self.backend = BlockStore(config)

    async def __aenter__(self) -> Store:
        await self.backend.start()
        self.server = await serve([registration(KVStoreServicer(self.backend))], "127.0.0.1:0", handle_signals=False)
        self.client = KVStoreClient(self.server.address, client_id="test")
        try:
            await self.server.set_ready()
            await self.client.connect(LAYOUT)
        except BaseException:
            await self.__aexit__()  # a failed start leaves no server running
            raise
        self.stub = kvstore_pb2_grpc.KVStoreStub(self.client._channel)
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self.client.close()
        await self.server.drain(0)
        await self.backend.shutdown()


def chain(num_blocks: int, seed: int = 0) -> tuple[list[bytes], torch.Tensor]:
    """Chained hashes of a prompt and random per-block payloads [n, L, 2, BS, Hkv, D]."""
    tokens = list(range(seed * 1000, seed * 1000 + num_blocks * LAYOUT.block_size))
    generator = torch.Generator().manual_seed(seed)
    return block_hashes(tokens, LAYOUT.block_size, b"ns"), torch.randn(num_blocks, 2, 2, 4, 2, 4, generator=generator)


async def test_connect_refuses_other_layouts():
    async with Store(StoreConfig(ram_bytes=1 << 20)) as store:
        again = KVStoreClient(store.server.address)
        assert await again.connect(LAYOUT) == store.client.layout_id and again.block_num_bytes == BLOCK_BYTES
        for field, value in (("dtype", "bfloat16"), ("block_size", 8), ("model_id", "other"), ("num_layers", 3)):
            with pytest.raises(grpc.aio.AioRpcError) as raised:
                await again.connect(dataclasses.replace(LAYOUT, **{field: value}))
            assert raised.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert raised.value.details().startswith(f"layout.{field}: this store holds {field}=")
        await again.close()


async def test_put_lookup_get_exact_bytes():
    async with Store(StoreConfig(ram_bytes=1 << 20)) as store:
        hashes, blocks = chain(5)
        result = await store.client.put(hashes[:3], blocks[:3])
        assert (result.num_stored, result.num_already_present) == (3, 0)
        result = await store.client.put(hashes[2:], blocks[2:], parent_hash=hashes[1])
        assert (result.num_stored, result.num_already_present) == (2, 1)
        assert await store.client.lookup(hashes) == 5
        other, _ = chain(2, seed=9)
        assert await store.client.lookup([*hashes[:2], other[0], hashes[3]]) == 2
        got = await store.client.get([*hashes[:4], other[1], hashes[4]])  # stops at the miss
        assert got.shape == (4, 2, 2, 4, 2, 4) and torch.equal(got, blocks[:4])
        messages = [m async for m in store.stub.Get(k.GetRequest(layout_id=store.client.layout_id, block_hashes=hashes[:2]))]
        assert [m.parent_hash for m in messages] == [b"", hashes[0]]
        stats = await store.client.stats()
        # lookups: 5 hits + 2 hits/2 misses; get: 4 hits, 2 misses; raw get: 2 hits
        assert (stats.hits, stats.misses) == (13, 4)
        assert (stats.bytes_stored, stats.bytes_served, stats.num_blocks_ram) == (5 * BLOCK_BYTES, 6 * BLOCK_BYTES, 5)


async def test_cache_round_trip_through_paged_layout():
    async with Store(StoreConfig(ram_bytes=1 << 20)) as store:
        cache = torch.randn(2, 2, 8, 4, 2, 4)
        hashes, _ = chain(3, seed=4)
        await store.client.put(hashes, gather_blocks(cache, [6, 1, 3]))
        target = torch.zeros_like(cache)
        scatter_blocks(target, [0, 2, 7], await store.client.get(hashes))
        assert torch.equal(target[:, :, [0, 2, 7]], cache[:, :, [6, 1, 3]])


async def test_put_errors():
    async with Store(StoreConfig(ram_bytes=1 << 20)) as store:
        payload = c.Tensor(dtype=c.DTYPE_FLOAT32, shape=[2, 2, 4, 2, 4], data=bytes(BLOCK_BYTES))
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            await store.stub.Put(iter([k.KVBlock(hash=b"h", layout_id="nope", payload=payload)]))
        assert raised.value.code() == grpc.StatusCode.NOT_FOUND
        assert raised.value.details().startswith("blocks[0].layout_id: unknown layout id 'nope'")
        wrong = c.Tensor(dtype=c.DTYPE_FLOAT32, shape=[2, 2, 4, 4, 2], data=bytes(BLOCK_BYTES))
        good = k.KVBlock(hash=b"g", layout_id=store.client.layout_id, payload=payload)
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            await store.stub.Put(iter([good, k.KVBlock(hash=b"w", layout_id=store.client.layout_id, payload=wrong)]))
        assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "blocks[1].payload: payload is float32 [2, 2, 4, 4, 2], the layout needs float32 [2, 2, 4, 2, 4]" in raised.value.details()
        for call in (store.stub.Lookup(k.LookupRequest(layout_id="nope", block_hashes=[b"h"])),):
            with pytest.raises(grpc.aio.AioRpcError) as raised:
                await call
            assert raised.value.code() == grpc.StatusCode.NOT_FOUND


async def test_ram_lru_eviction_order():
    async with Store(StoreConfig(ram_bytes=3 * BLOCK_BYTES)) as store:
        hashes, blocks = chain(5, seed=1)
        await store.client.put(hashes[:3], blocks[:3])
        assert await store.client.lookup(hashes[:1]) == 1  # block 0 is now the most recent
        await store.client.put(hashes[3:4], blocks[3:4], parent_hash=hashes[2])  # evicts block 1
        present = [await store.client.lookup([h]) for h in hashes[:4]]
        assert present == [1, 0, 1, 1]
        # those lookups refreshed 0, 2, 3 in that order: block 0 is the LRU now
        await store.client.put(hashes[4:], blocks[4:])
        assert [await store.client.lookup([h]) for h in (hashes[0], hashes[2], hashes[3], hashes[4])] == [0, 1, 1, 1]
        stats = await store.client.stats()
        assert (stats.evictions, stats.num_blocks_ram, stats.num_blocks_disk) == (2, 3, 0)


async def test_disk_tier_survives_restart(tmp_path: Path):
    config = StoreConfig(ram_bytes=2 * BLOCK_BYTES, disk_path=tmp_path, disk_bytes=3 * BLOCK_BYTES)
    hashes, blocks = chain(6, seed=2)
    async with Store(config) as store:
        await store.client.put(hashes[:3], blocks[:3])
        stats = await store.client.stats()
        # the disk holds every block, RAM caches the two most recent
        assert (stats.num_blocks_ram, stats.num_blocks_disk, stats.evictions) == (2, 3, 0)
        assert torch.equal(await store.client.get(hashes[:3]), blocks[:3])  # block 0 read from disk
        await store.client.put(hashes[3:], blocks[3:], parent_hash=hashes[2])
        stats = await store.client.stats()
        # 6 blocks, room for 3 on disk: the least recently used three were dropped, from RAM too
        assert (stats.num_blocks_ram, stats.num_blocks_disk, stats.evictions) == (2, 3, 3)
        assert stats.bytes_stored == 3 * BLOCK_BYTES
        assert await store.client.lookup(hashes) == 0
        assert await store.client.lookup(hashes[3:]) == 3
    async with Store(config) as store:  # restart: the layout and every block were kept
        stats = await store.client.stats()
        assert (stats.num_blocks_ram, stats.num_blocks_disk) == (0, 3)
        assert await store.client.lookup(hashes[3:]) == 3
        assert torch.equal(await store.client.get(hashes[3:]), blocks[3:])
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            await KVStoreClient(store.server.address).connect(dataclasses.replace(LAYOUT, head_dim=8))
        assert raised.value.code() == grpc.StatusCode.FAILED_PRECONDITION


async def test_torn_and_corrupt_files_are_dropped(tmp_path: Path):
    config = StoreConfig(ram_bytes=BLOCK_BYTES // 2, disk_path=tmp_path, disk_bytes=1 << 20)
    hashes, blocks = chain(3, seed=3)
    async with Store(config) as store:
        await store.client.put(hashes, blocks)
        assert (await store.client.stats()).num_blocks_disk == 3
    files = {path.name: path for path in tmp_path.glob("blocks/*/*.kvb")}
    torn = files[hashes[2].hex() + ".kvb"]
    torn.write_bytes(torn.read_bytes()[:-7])  # a write cut short
    flipped = files[hashes[1].hex() + ".kvb"]
    data = bytearray(flipped.read_bytes())
    data[-1] ^= 0x40  # a bit flip inside the payload: same length, bad checksum
    flipped.write_bytes(bytes(data))
    async with Store(config) as store:
        assert (await store.client.stats()).num_blocks_disk == 2  # torn file dropped at start
        assert not torn.exists()
        got = await store.client.get(hashes)
        assert got.shape[0] == 1 and torch.equal(got[0], blocks[0])  # corrupt block 1 is a miss
        assert not flipped.exists() and await store.client.lookup(hashes) == 1


async def test_get_stream_cancellation():
    async with Store(StoreConfig(ram_bytes=1 << 20)) as store:
        hashes, blocks = chain(200, seed=5)
        await store.client.put(hashes, blocks)
        call = store.stub.Get(k.GetRequest(layout_id=store.client.layout_id, block_hashes=hashes))
        first = await call.read()
        assert first.hash == hashes[0]
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call.read()
        await asyncio.sleep(0.05)
        stats = await store.client.stats()
        assert BLOCK_BYTES <= stats.bytes_served < 200 * BLOCK_BYTES  # the stream stopped early
        assert await store.client.lookup(hashes) == 200  # the store is still serving
