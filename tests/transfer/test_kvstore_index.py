"""StoredIndex and KVStoreClient.watch against a real store over loopback: the index
follows puts and evictions, is not live while its stream is down, and resubscribes."""

from __future__ import annotations

import pytest

from cleave.transfer.kvstore_index import StoredIndex
from services.kvstore.store import StoreConfig
from tests.services.kvstore.test_store import BLOCK_BYTES, Store, chain

WAIT_S = 5.0


async def test_index_counts_leading_hashes_and_is_live_only_after_a_snapshot():
    index = StoredIndex()
    index.apply([b"a", b"b"], [])
    assert not index.is_live and index.num_leading([b"a", b"b"]) == 2
    index.apply([b"d"], [], snapshot_done=True)
    assert index.is_live
    index.apply([b"c"], [b"b"])
    assert (index.num_leading([b"a", b"b", b"c"]), index.num_leading([b"c", b"d", b"x"]), index.num_leading([])) == (1, 2, 0)
    index.reset()
    assert not index.is_live and len(index) == 0 and index.num_leading([b"a"]) == 0
    with pytest.raises(TimeoutError):
        await index.wait_until(lambda i: i.is_live, timeout_s=0.01)


async def test_the_index_follows_puts_and_evictions():
    async with Store(StoreConfig(ram_bytes=3 * BLOCK_BYTES)) as store:
        client = store.client
        hashes, blocks = chain(4)
        await client.put(hashes[:2], blocks[:2])
        assert not client.index.is_live  # nothing watched yet
        index = await client.watch()
        assert index is client.index and await client.watch() is index  # a second call changes nothing
        await index.wait_until(lambda i: i.is_live, WAIT_S)
        assert index.num_leading(hashes) == 2
        await client.put(hashes[2:], blocks[2:], parent_hash=hashes[1])  # evicts block 0
        await index.wait_until(lambda i: hashes[0] not in i, WAIT_S)
        assert [h in index for h in hashes] == [False, True, True, True] and index.num_leading(hashes[1:]) == 3
        assert client.num_watch_calls == 1


async def test_a_client_ended_for_falling_behind_resubscribes_to_a_correct_index():
    async with Store(StoreConfig(ram_bytes=1 << 20, watch_queue_hashes=2)) as store:
        client = store.client
        hashes, blocks = chain(5)
        await client.put(hashes[:1], blocks[:1])
        index = await client.watch()
        await index.wait_until(lambda i: i.is_live, WAIT_S)
        await client.put(hashes[1:4], blocks[1:4], parent_hash=hashes[0])  # 3 hashes > the queue's 2: ended
        await index.wait_until(lambda i: client.num_watch_calls == 2 and i.is_live, WAIT_S)
        assert index.num_leading(hashes) == 4 and len(index) == 4  # the fresh snapshot
        await client.put(hashes[4:], blocks[4:], parent_hash=hashes[3])  # and it follows again
        await index.wait_until(lambda i: i.num_leading(hashes) == 5, WAIT_S)


async def test_the_index_is_not_live_while_the_store_is_gone_and_close_stops_the_watch():
    async with Store(StoreConfig(ram_bytes=1 << 20)) as store:
        client = store.client
        index = await client.watch()
        await index.wait_until(lambda i: i.is_live, WAIT_S)
        await store.backend.drain()  # ends the stream; new ones are refused
        await index.wait_until(lambda i: not i.is_live, WAIT_S)
        task = client._watch_task
        assert task is not None and not task.done()  # still trying
        await client.close()
        assert task.done() and client._watch_task is None and not index.is_live
