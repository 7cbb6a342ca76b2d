"""KVStorePrefix.fetch with the store's index: a live index answers without a Lookup round
trip (counted by the store), a stale one costs only what a Get no longer finds, and without
a live index fetch asks the store as before; a store that does not answer costs a fetch a
short deadline, then is skipped for a while (prompts compute), and a prefill never waits for it."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest
import torch

from cleave.proto.cleave.v1 import kvstore_pb2 as k
from cleave.proto.cleave.v1 import prefill_pb2 as p
from cleave.rpc.prefill_call import prefill_response
from services.prefill import kvstore_prefix
from tests.worker.cluster import greedy, start_kvstore, start_prefill, wait_pool_full

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


@pytest.mark.parametrize("hangs", ["get", "lookup"])
async def test_a_store_that_does_not_answer_is_skipped_after_one_short_wait(checkpoint, kvstore, monkeypatch, hangs):
    """A hung store (stopped, not dead: its connections stay open) with the index live (the
    Get hangs) or not (the Lookup does)."""
    monkeypatch.setattr(kvstore_prefix, "LOOKUP_TIMEOUT_S", 0.3)
    monkeypatch.setattr(kvstore_prefix, "GET_TIMEOUT_S", 0.3)
    worker = await start_prefill(checkpoint, kvstore.server.address)
    prefix = worker.backend.kvstore
    released = asyncio.Event()  # set at the end: the hung calls return
    asked: list[str] = []
    try:
        await prefix.start()
        index = prefix.client.index
        if hangs == "get":
            hashes, other = await store_blocks(prefix, PROMPT, 4), await store_blocks(prefix, OTHER, 4)
            await index.wait_until(lambda i: i.is_live and i.num_leading(hashes) == i.num_leading(other) == 4, WAIT_S)

            async def hung_get(layout_id, block_hashes):  # type: ignore[no-untyped-def]
                asked.append("get")
                await released.wait()
                yield  # (an async generator, as the store's)

            monkeypatch.setattr(kvstore.backend, "get", hung_get)
        else:
            await index.wait_until(lambda i: i.is_live, WAIT_S)
            index.reset()  # not live until the next Watch's snapshot: fetches ask the store

            async def hung_lookup(layout_id, block_hashes):  # type: ignore[no-untyped-def]
                asked.append("lookup")
                await released.wait()
                return 0

            monkeypatch.setattr(kvstore.backend, "lookup", hung_lookup)
        started = time.monotonic()
        with pytest.raises(grpc.aio.AioRpcError) as cut:
            await prefix.fetch("hung", PROMPT)
        assert cut.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED
        assert time.monotonic() - started < 20  # the fetch's own deadline, not the client's 30 s
        skipped = await prefix.fetch("skipped", PROMPT)  # the store is not asked again for a while
        assert (skipped.num_store_blocks, skipped.num_loaded_blocks) == (0, 0) and asked == [hangs]
        answer = await prefill_response(worker.stub.Prefill(p.PrefillRequest(
            request_id="computed", prompt_token_ids=PROMPT, sampling=greedy(2))))
        assert answer.num_computed_tokens == len(PROMPT) and asked == [hangs]
        prefix._skip_until = 0.0  # the period is over: the next fetch asks again (of a prompt not computed here)
        with pytest.raises(grpc.aio.AioRpcError):
            await prefix.fetch("again", OTHER)
        assert asked == [hangs, hangs]
        await wait_pool_full(worker.stub)
    finally:
        released.set()
        await worker.close()
