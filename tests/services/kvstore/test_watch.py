"""KVStore Watch over real gRPC: the snapshot, live put and removal events, bounded queues,
unknown layouts, the internal token, and the end of every stream at shutdown."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from cleave.errors import ResourceExhausted, Unavailable
from cleave.proto.cleave.v1 import kvstore_pb2 as k, kvstore_pb2_grpc
from cleave.rpc import aio_channel
from cleave.rpc.convert import kv_layout_to_proto
from services.kvstore import watch
from services.kvstore.backend import BlockEvent
from services.kvstore.store import StoreConfig
from services.kvstore.watch import WatchHub
from tests.services.kvstore.test_store import BLOCK_BYTES, LAYOUT, Store, chain
from tests.worker.cluster import start_kvstore

READ_TIMEOUT_S = 5.0


async def read(call) -> k.BlockEvents:  # type: ignore[no-untyped-def]
    message = await asyncio.wait_for(call.read(), READ_TIMEOUT_S)
    assert message is not grpc.aio.EOF, "the Watch stream ended"
    return message


async def snapshot(call) -> list[bytes]:  # type: ignore[no-untyped-def]
    """The hashes of a Watch stream's snapshot (its messages up to snapshot_done)."""
    hashes: list[bytes] = []
    while True:
        message = await read(call)
        assert not message.removed_hashes
        hashes += message.stored_hashes
        if message.snapshot_done:
            return hashes


def watch_call(store: Store):  # type: ignore[no-untyped-def]
    return store.stub.Watch(k.WatchRequest(layout_id=store.client.layout_id))


async def test_snapshot_then_puts_then_removals_on_eviction():
    async with Store(StoreConfig(ram_bytes=3 * BLOCK_BYTES)) as store:  # RAM only: what falls out is gone
        hashes, blocks = chain(4)
        await store.client.put(hashes[:2], blocks[:2])
        call = watch_call(store)
        try:
            assert await snapshot(call) == hashes[:2]
            await store.client.put(hashes[2:], blocks[2:], parent_hash=hashes[1])  # 4 blocks > 3: evicts the oldest
            stored, removed = await read(call), await read(call)
            assert (list(stored.stored_hashes), list(stored.removed_hashes), stored.snapshot_done) == (hashes[2:], [], False)
            assert (list(removed.stored_hashes), list(removed.removed_hashes)) == ([], hashes[:1])
            await store.client.put(hashes[1:3], blocks[1:3], parent_hash=hashes[0])  # all present: no event
            other, other_blocks = chain(1, seed=5)
            await store.client.put(other, other_blocks)
            stored, removed = await read(call), await read(call)
            assert list(stored.stored_hashes) == other
            assert list(removed.removed_hashes) == [hashes[3]]  # the put above refreshed blocks 1 and 2
            assert (await store.client.stats()).evictions == 2
        finally:
            call.cancel()


async def test_blocks_moved_from_ram_to_disk_stay_stored(tmp_path):
    config = StoreConfig(ram_bytes=BLOCK_BYTES, disk_path=tmp_path / "store", disk_bytes=3 * BLOCK_BYTES)
    async with Store(config) as store:
        hashes, blocks = chain(4)
        call = watch_call(store)
        try:
            assert await snapshot(call) == []
            await store.client.put(hashes[:3], blocks[:3])  # RAM holds one, the disk all three
            assert list((await read(call)).stored_hashes) == hashes[:3]
            await store.client.put(hashes[3:], blocks[3:], parent_hash=hashes[2])  # the disk evicts the oldest
            assert list((await read(call)).stored_hashes) == hashes[3:]
            assert list((await read(call)).removed_hashes) == hashes[:1]
            again = watch_call(store)
            try:
                assert sorted(await snapshot(again)) == sorted(hashes[1:])
            finally:
                again.cancel()
        finally:
            call.cancel()


async def test_the_snapshot_and_large_puts_come_in_bounded_parts(monkeypatch):
    monkeypatch.setattr(watch, "EVENT_MAX_HASHES", 2)
    async with Store(StoreConfig(ram_bytes=1 << 20)) as store:
        hashes, blocks = chain(8)
        await store.client.put(hashes[:5], blocks[:5])
        call = watch_call(store)
        try:
            parts = [await read(call) for _ in range(3)]
            assert [list(m.stored_hashes) for m in parts] == [hashes[0:2], hashes[2:4], hashes[4:5]]
            assert [m.snapshot_done for m in parts] == [False, False, True]
            await store.client.put(hashes[5:], blocks[5:], parent_hash=hashes[4])
            assert [list((await read(call)).stored_hashes) for _ in range(2)] == [hashes[5:7], hashes[7:]]
        finally:
            call.cancel()


async def test_an_empty_store_sends_one_empty_snapshot_message_and_unknown_layouts_are_not_found():
    async with Store(StoreConfig(ram_bytes=1 << 20)) as store:
        call = watch_call(store)
        try:
            message = await read(call)
            assert (list(message.stored_hashes), message.snapshot_done) == ([], True)
        finally:
            call.cancel()
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            await store.stub.Watch(k.WatchRequest(layout_id="nope")).read()
        assert raised.value.code() == grpc.StatusCode.NOT_FOUND
        assert raised.value.details().startswith("layout_id: unknown layout id 'nope'")
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            await store.stub.Watch(k.WatchRequest()).read()
        assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT


async def test_a_watcher_sent_more_than_its_queue_holds_is_ended_and_the_put_goes_on():
    async with Store(StoreConfig(ram_bytes=1 << 20, watch_queue_hashes=2)) as store:
        hashes, blocks = chain(3)
        call = watch_call(store)
        try:
            assert await snapshot(call) == []
            assert (await store.client.put(hashes, blocks)).num_stored == 3  # one event of 3 hashes > 2
            with pytest.raises(grpc.aio.AioRpcError) as raised:
                await read(call)
            assert raised.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "this watcher fell behind: 3 hashes queued, at most 2" in raised.value.details()
            assert "call Watch again for a fresh snapshot" in raised.value.details()
        finally:
            call.cancel()
        again = watch_call(store)
        try:
            assert await snapshot(again) == hashes  # a snapshot is not bounded by the queue
        finally:
            again.cancel()


async def test_publishing_never_waits_for_a_slow_watcher_and_ends_it():
    hub = WatchHub(max_queued_hashes=3)
    slow, reader = hub.subscribe([b"a"]), hub.subscribe([])
    events = reader.events()
    assert await anext(events) == BlockEvent(snapshot_done=True)
    hub.publish(stored=[b"b", b"c"])
    assert await anext(events) == BlockEvent(stored=(b"b", b"c"))  # the reader keeps up, the slow one does not
    hub.publish(removed=[b"a", b"b"])  # the slow one: 2 + 2 queued > 3, ended; nothing waited
    assert len(hub) == 1 and hub.num_overflowed == 1
    assert await anext(events) == BlockEvent(removed=(b"a", b"b"))
    with pytest.raises(ResourceExhausted, match="4 hashes queued, at most 3"):
        [event async for event in slow.events()]
    hub.publish(stored=[b"d"])
    hub.close()  # shutdown ends the stream at once, queued changes included (a new snapshot has them)
    assert [event async for event in events] == []
    assert len(hub) == 0
    with pytest.raises(Unavailable, match="shutting down"):
        hub.subscribe([])


async def test_watch_streams_end_when_the_store_drains():
    async with Store(StoreConfig(ram_bytes=1 << 20)) as store:
        call = watch_call(store)
        assert await snapshot(call) == []
        await store.backend.drain()
        assert await asyncio.wait_for(call.read(), READ_TIMEOUT_S) is grpc.aio.EOF
        assert await call.code() == grpc.StatusCode.OK
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            await watch_call(store).read()
        assert raised.value.code() == grpc.StatusCode.UNAVAILABLE


async def test_watch_needs_the_internal_token():
    kvstore = await start_kvstore()
    try:
        layout_id = (await kvstore.stub.Connect(k.ConnectRequest(layout=kv_layout_to_proto(LAYOUT)))).layout_id
        call = kvstore.stub.Watch(k.WatchRequest(layout_id=layout_id))  # the stub sends the token
        try:
            assert (await read(call)).snapshot_done
        finally:
            call.cancel()
        for token in (None, "guess"):
            async with aio_channel(kvstore.server.address, internal_token=token) as channel:
                with pytest.raises(grpc.aio.AioRpcError) as raised:
                    await kvstore_pb2_grpc.KVStoreStub(channel).Watch(k.WatchRequest(layout_id=layout_id)).read()
                assert raised.value.code() == grpc.StatusCode.UNAUTHENTICATED
    finally:
        await kvstore.close()

