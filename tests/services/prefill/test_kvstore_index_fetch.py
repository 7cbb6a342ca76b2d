"""KVStorePrefix.fetch with the store's index: a live index answers without a Lookup round
trip (counted by the store), a stale one costs only what a Get no longer finds, and without
a live index fetch asks the store as before."""

from __future__ import annotations

import pytest
import torch

from cleave.proto.cleave.v1 import kvstore_pb2 as k
from tests.worker.cluster import start_kvstore, start_prefill, wait_pool_full

PROMPT = list(range(30, 49))  # 19 tokens: 4 full blocks of 4 before the last token
OTHER = list(range(100, 119))
WAIT_S = 5.0


@pytest.fixture
async def kvstore():
    store = await start_kvstore()
    yield store
    await store.close()


async def num_lookups(kvstore) -> int:  # type: ignore[no-untyped-def]
    """Lookup calls the store answered (its Stats counter)."""
    return (await kvstore.stub.Stats(k.StatsRequest())).num_lookups


async def store_blocks(prefix, prompt: list[int], num_blocks: int) -> list[bytes]:  # type: ignore[no-untyped-def]
    """Put the prompt's first blocks (random KV) into the store through the worker's client."""
    hashes = prefix.hashes(prompt)[:num_blocks]
    blocks = torch.randn(num_blocks, *prefix.client.block_shape)
    assert (await prefix.client.put(hashes, blocks)).num_stored == num_blocks
    return hashes


async def test_a_miss_asks_the_store_until_the_index_is_live_then_never(checkpoint, kvstore):
    worker = await start_prefill(checkpoint, kvstore.server.address)
    prefix = worker.backend.kvstore
    try:
        assert not prefix.client.index.is_live  # the backend has not started the watch
        fetch = await prefix.fetch("cold", PROMPT)
        assert (fetch.num_store_blocks, fetch.num_loaded_blocks) == (0, 0)
        assert await num_lookups(kvstore) == 1  # the fallback: a Lookup round trip
        await prefix.start()
        await prefix.client.index.wait_until(lambda i: i.is_live, WAIT_S)
        for request_id in ("miss-1", "miss-2"):
            fetch = await prefix.fetch(request_id, PROMPT)
            assert (fetch.num_store_blocks, fetch.num_loaded_blocks, fetch.hashes) == (0, 0, tuple(prefix.hashes(PROMPT)))
        assert await num_lookups(kvstore) == 1  # no round trip for a miss
    finally:
        await worker.close()
    assert worker.backend.kvstore.client._watch_task is None  # the backend's close stopped the watch


async def test_a_live_index_loads_the_stored_prefix_and_a_stale_one_uses_what_arrives(checkpoint, kvstore):
    worker = await start_prefill(checkpoint, kvstore.server.address)
    prefix = worker.backend.kvstore
    engine = worker.backend.async_engine
    try:
        await prefix.start()
        index = prefix.client.index
        hashes = await store_blocks(prefix, PROMPT, 4)
        await index.wait_until(lambda i: i.is_live and i.num_leading(hashes) == 4, WAIT_S)
        fetch = await prefix.fetch("hit", PROMPT)
        assert (fetch.num_store_blocks, fetch.num_loaded_blocks) == (4, 4)
        await engine.call(lambda e: e.handoff.release_hold("hit"))
        assert await engine.call(lambda e: e.handoff.num_cached_blocks(hashes)) == 4  # in the prefix cache now

        other = prefix.hashes(OTHER)
        await store_blocks(prefix, OTHER, 2)
        await index.wait_until(lambda i: i.num_leading(other) == 2, WAIT_S)
        index.apply(other[2:4], [])  # the index lists two blocks the store does not hold (stale)
        fetch = await prefix.fetch("stale", OTHER)
        assert (fetch.num_store_blocks, fetch.num_loaded_blocks) == (2, 2)  # the Get's 2 blocks, loaded
        await engine.call(lambda e: e.handoff.release_hold("stale"))
        assert await engine.call(lambda e: e.handoff.num_cached_blocks(other)) == 2

        index.apply([], other[:2])  # stale the other way: blocks stored, unknown to the index
        fetch = await prefix.fetch("missed", OTHER)
        assert (fetch.num_store_blocks, fetch.num_loaded_blocks) == (0, 0)  # a missed reuse, nothing worse
        assert await num_lookups(kvstore) == 0
        await wait_pool_full(worker.stub)
    finally:
        await worker.close()
