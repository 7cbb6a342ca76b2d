"""store_to_kvstore: the first token returns before the kvstore put, which runs in the
background; the prompt's blocks are released on every path and the stored prefix is found
by the next worker."""

from __future__ import annotations

import asyncio

import pytest

import services.prefill.engine_backend as engine_backend
from cleave.errors import Unavailable
from cleave.proto.cleave.v1 import common_pb2 as c
from cleave.proto.cleave.v1 import prefill_pb2 as p
from cleave.rpc.prefill_call import prefill_response
from tests.worker.cluster import greedy, start_kvstore, start_prefill, wait_pool_full

PROMPT = list(range(30, 49))  # 19 tokens: 4 full blocks of 4 (+ 3 tokens)
NUM_FULL_BLOCKS = 4


def storing(request_id: str) -> p.PrefillRequest:
    return p.PrefillRequest(request_id=request_id, prompt_token_ids=PROMPT, sampling=greedy(4), store_to_kvstore=True)


async def num_free_blocks(worker) -> int:  # type: ignore[no-untyped-def]
    return (await worker.stub.GetLoad(c.GetLoadRequest())).load.num_free_blocks


@pytest.fixture
async def kvstore():
    store = await start_kvstore()
    yield store.server.address
    await store.close()


def seen_before(worker, prompt: list[int] = PROMPT) -> None:  # type: ignore[no-untyped-def]
    """Make the worker remember having computed the prompt once: its blocks go to the store."""
    kvstore = worker.backend.kvstore
    kvstore.repeated(kvstore.hashes(prompt))


def gate(obj, name: str) -> asyncio.Event:  # type: ignore[no-untyped-def]
    """Make `obj.name` (a coroutine method) wait for the returned event before it runs."""
    opened = asyncio.Event()
    original = getattr(obj, name)

    async def gated(*args, **kwargs):  # type: ignore[no-untyped-def]
        await opened.wait()
        return await original(*args, **kwargs)

    setattr(obj, name, gated)
    return opened


async def test_first_token_does_not_wait_for_the_put(checkpoint, kvstore):
    first, second = await start_prefill(checkpoint, kvstore), await start_prefill(checkpoint, kvstore)
    try:
        seen_before(first)
        put_allowed = gate(first.backend.kvstore.client, "put")
        response = await asyncio.wait_for(prefill_response(first.stub.Prefill(storing("a"))), timeout=10)
        assert (response.num_prompt_tokens, response.num_computed_tokens) == (19, 19)
        assert not await first.backend.wait_for_stores(timeout_s=0.05)  # the put is still waiting
        assert first.backend.counters.num_kvstore_blocks_stored == 0
        await wait_pool_full(first.stub)  # gathered to host memory: the blocks are free already
        put_allowed.set()
        assert await first.backend.wait_for_stores(timeout_s=5)
        assert first.backend.counters.num_kvstore_blocks_stored == NUM_FULL_BLOCKS
        # A cold worker finds the prefix in the store once the put finished.
        warm = await prefill_response(second.stub.Prefill(p.PrefillRequest(request_id="b", prompt_token_ids=PROMPT, sampling=greedy(4))))
        assert (warm.num_cached_tokens, warm.num_computed_tokens) == (16, 3)
        assert warm.first_token_ids == response.first_token_ids
        assert second.backend.counters.num_kvstore_blocks_loaded == NUM_FULL_BLOCKS
        for worker in (first, second):
            await wait_pool_full(worker.stub)
    finally:
        for worker in (first, second):
            await worker.close()


async def test_a_salted_prefix_in_the_store_is_found_only_under_its_salt(checkpoint, kvstore):
    first, second = await start_prefill(checkpoint, kvstore), await start_prefill(checkpoint, kvstore)

    def request(request_id: str, salt: str = "", store: bool = False) -> p.PrefillRequest:
        sampling = greedy(4)
        sampling.cache_salt = salt
        return p.PrefillRequest(request_id=request_id, prompt_token_ids=PROMPT, sampling=sampling,
                                store_to_kvstore=store)

    try:
        prefix = first.backend.kvstore
        prefix.repeated(prefix.hashes(PROMPT, "tenant-a"))  # computed once before: the put sends it
        stored = await prefill_response(first.stub.Prefill(request("a", "tenant-a", store=True)))
        assert await first.backend.wait_for_stores(timeout_s=5)
        assert first.backend.counters.num_kvstore_blocks_stored == NUM_FULL_BLOCKS
        for request_id, salt in [("unsalted", ""), ("b", "tenant-b")]:
            miss = await prefill_response(second.stub.Prefill(request(request_id, salt)))
            assert (miss.num_cached_tokens, second.backend.counters.num_kvstore_blocks_loaded) == (0, 0), salt
        hit = await prefill_response(second.stub.Prefill(request("a-again", "tenant-a")))
        assert (hit.num_cached_tokens, second.backend.counters.num_kvstore_blocks_loaded) == (16, NUM_FULL_BLOCKS)
        assert hit.first_token_ids == stored.first_token_ids == miss.first_token_ids
        for worker in (first, second):
            await wait_pool_full(worker.stub)
    finally:
        for worker in (first, second):
            await worker.close()


async def test_blocks_stay_held_until_gathered_and_a_failed_put_is_only_logged(checkpoint, kvstore):
    worker = await start_prefill(checkpoint, kvstore)
    try:
        total = await num_free_blocks(worker)
        kvstore_prefix = worker.backend.kvstore
        gather_allowed = gate(kvstore_prefix, "gather")

        async def failing_put(*args, **kwargs):  # type: ignore[no-untyped-def]
            raise Unavailable("the kvstore is down")

        kvstore_prefix.client.put = failing_put
        await prefill_response(worker.stub.Prefill(storing("held")))
        assert await num_free_blocks(worker) == total - 5  # the prompt's 5 blocks wait for the gather
        gather_allowed.set()
        assert await worker.backend.wait_for_stores(timeout_s=5)
        assert worker.backend.counters.num_kvstore_blocks_stored == 0
        await wait_pool_full(worker.stub)
        # The same request id again (its earlier put is done): served like any other.
        again = await prefill_response(worker.stub.Prefill(storing("held")))
        assert again.num_cached_tokens == 16
        assert await worker.backend.wait_for_stores(timeout_s=5)
        await wait_pool_full(worker.stub)
    finally:
        await worker.close()


async def test_shutdown_cancels_a_pending_put_and_frees_its_blocks(checkpoint, kvstore, monkeypatch):
    monkeypatch.setattr(engine_backend, "STORE_DRAIN_S", 0.1)
    worker = await start_prefill(checkpoint, kvstore)
    engine = worker.backend.engine
    gate(worker.backend.kvstore, "gather")  # never opened
    await prefill_response(worker.stub.Prefill(storing("stuck")))
    assert engine.kv.num_free_blocks == engine.kv.num_usable_blocks - 5
    await worker.close()
    assert await worker.backend.wait_for_stores(timeout_s=0)
    assert engine.kv.num_free_blocks == engine.kv.num_usable_blocks


async def test_a_full_put_backlog_skips_the_store_and_frees_the_blocks(checkpoint, kvstore):
    worker = await start_prefill(checkpoint, kvstore)
    try:
        block_bytes = worker.backend.engine.kv_cache[:, :, 0].nbytes
        worker.backend.puts.max_bytes = 5 * block_bytes  # room for one 5-block prompt
        seen_before(worker)
        put_allowed = gate(worker.backend.kvstore.client, "put")
        await prefill_response(worker.stub.Prefill(storing("first")))  # its put waits: the backlog is full
        second = await prefill_response(worker.stub.Prefill(storing("second")))
        assert second.num_computed_tokens + second.num_cached_tokens == 19
        assert worker.backend.counters.num_kvstore_puts_skipped == 1
        put_allowed.set()
        assert await worker.backend.wait_for_stores(timeout_s=5)
        assert worker.backend.counters.num_kvstore_blocks_stored == NUM_FULL_BLOCKS
        await wait_pool_full(worker.stub)
        await prefill_response(worker.stub.Prefill(storing("third")))  # the backlog drained: stored again
        assert await worker.backend.wait_for_stores(timeout_s=5)
        assert worker.backend.counters.num_kvstore_puts_skipped == 1
        await wait_pool_full(worker.stub)
    finally:
        await worker.close()


async def test_puts_go_to_the_store_one_at_a_time_in_order():
    """Concurrent puts queue: the store never sees two put streams of this worker at once."""
    from types import SimpleNamespace

    import torch

    from cleave.transfer import KVStorePutResult
    from services.prefill.kvstore_prefix import KVStorePrefix, StorePayload

    events: list[str] = []
    release = asyncio.Event()

    class SlowClient:
        async def put(self, hashes, blocks, parent_hash=b""):  # type: ignore[no-untyped-def]
            events.append(f"start {hashes[0].decode()}")
            await release.wait()
            events.append(f"end {hashes[0].decode()}")
            return KVStorePutResult(num_stored=len(hashes), num_already_present=0)

    engine = SimpleNamespace(handoff=SimpleNamespace(block_size=4, pairs_window_pages=False))
    prefix = KVStorePrefix(SlowClient(), engine, async_engine=None)  # type: ignore[arg-type]
    payloads = [StorePayload([name.encode()] * size, torch.zeros(size, 1), b"") for name, size in (("a", 2), ("b", 3), ("c", 1))]
    puts = [asyncio.ensure_future(prefix.put(payload)) for payload in payloads]
    await asyncio.sleep(0.05)
    assert events == ["start a"]  # b and c wait for a's stream to end
    release.set()
    assert await asyncio.gather(*puts) == [2, 3, 1]
    assert events == ["start a", "end a", "start b", "end b", "start c", "end c"]


async def test_only_blocks_this_worker_computed_before_go_to_the_store(checkpoint, kvstore):
    """A prompt seen for the first time is not stored; the second time, its repeated leading
    blocks are (a prompt sharing two blocks with an earlier one stores those two)."""
    worker = await start_prefill(checkpoint, kvstore)
    try:
        await prefill_response(worker.stub.Prefill(storing("once")))
        assert await worker.backend.wait_for_stores(timeout_s=5)
        assert worker.backend.counters.num_kvstore_blocks_stored == 0
        shared = PROMPT[:8] + [200 + i for i in range(11)]  # the first two blocks repeat
        await prefill_response(worker.stub.Prefill(p.PrefillRequest(request_id="shared", prompt_token_ids=shared,
                                                   sampling=greedy(4), store_to_kvstore=True)))
        assert await worker.backend.wait_for_stores(timeout_s=5)
        assert worker.backend.counters.num_kvstore_blocks_stored == 2
        await prefill_response(worker.stub.Prefill(storing("twice")))  # blocks 3-4 repeat now too
        assert await worker.backend.wait_for_stores(timeout_s=5)
        assert worker.backend.counters.num_kvstore_blocks_stored == NUM_FULL_BLOCKS
        await wait_pool_full(worker.stub)
    finally:
        await worker.close()


async def test_short_prefixes_stay_out_of_the_store_and_recent_ones_skip_the_engine(checkpoint, kvstore):
    """With a threshold of 3 blocks (12 tokens): a prompt with fewer usable blocks is not
    even looked up, a repeated prefix shorter than that is not put, and a stored prefix this
    worker computed lately is left to its prefix cache without asking the engine thread."""
    worker = await start_prefill(checkpoint, kvstore, kvstore_min_prefix_tokens=12)
    client, prefix = worker.backend.kvstore.client, worker.backend.kvstore
    lookups: list[int] = []
    original_lookup = client.lookup

    async def counted_lookup(hashes):  # type: ignore[no-untyped-def]
        lookups.append(len(hashes))
        return await original_lookup(hashes)

    client.lookup = counted_lookup
    try:
        short = PROMPT[:11]  # 2 full blocks; (11 - 1) // 4 = 2 usable for a fetch: both < 3
        for request_id in ("short-1", "short-2"):
            await prefill_response(worker.stub.Prefill(p.PrefillRequest(request_id=request_id, prompt_token_ids=short,
                                                       sampling=greedy(2), store_to_kvstore=True)))
        assert await worker.backend.wait_for_stores(timeout_s=5)
        assert lookups == [] and worker.backend.counters.num_kvstore_blocks_stored == 0  # 2 repeated blocks < 3
        shared = PROMPT[:8] + [200 + i for i in range(11)]  # only two blocks in common with PROMPT
        await prefill_response(worker.stub.Prefill(p.PrefillRequest(request_id="shared", prompt_token_ids=shared,
                                                   sampling=greedy(2), store_to_kvstore=True)))
        assert await worker.backend.wait_for_stores(timeout_s=5)
        assert worker.backend.counters.num_kvstore_blocks_stored == 0  # 2 repeated blocks < 3
        await prefill_response(worker.stub.Prefill(storing("full-1")))
        await prefill_response(worker.stub.Prefill(storing("full-2")))  # all 4 blocks repeat now
        assert await worker.backend.wait_for_stores(timeout_s=5)
        assert worker.backend.counters.num_kvstore_blocks_stored == NUM_FULL_BLOCKS
        stored = prefix.hashes(PROMPT)[:NUM_FULL_BLOCKS]  # the index hears of the put over Watch, a moment later
        await client.index.wait_until(lambda i: i.is_live and i.num_leading(stored) == NUM_FULL_BLOCKS, 30)
        calls = 0
        original_call = worker.backend.async_engine.call

        async def counted_call(fn):  # type: ignore[no-untyped-def]
            nonlocal calls
            calls += 1
            return await original_call(fn)

        worker.backend.async_engine.call = counted_call
        fetch = await prefix.fetch("again", PROMPT)  # stored, and computed here: no engine round trip
        assert (fetch.num_store_blocks, fetch.num_loaded_blocks, calls) == (NUM_FULL_BLOCKS, 0, 0)
        worker.backend.async_engine.call = original_call
        await wait_pool_full(worker.stub)
    finally:
        client.lookup = original_lookup
        await worker.close()


async def test_a_prompt_is_hashed_once_for_its_lookup_and_its_put(checkpoint, kvstore):
    worker = await start_prefill(checkpoint, kvstore)
    prefix = worker.backend.kvstore
    calls = 0
    original = prefix.hashes

    def counted(prompt, cache_salt=""):  # type: ignore[no-untyped-def]
        nonlocal calls
        calls += 1
        return original(prompt, cache_salt)

    prefix.hashes = counted
    try:
        seen_before(worker)  # one call of its own
        calls = 0
        await prefill_response(worker.stub.Prefill(storing("once-hashed")))
        assert await worker.backend.wait_for_stores(timeout_s=5)
        assert worker.backend.counters.num_kvstore_blocks_stored == NUM_FULL_BLOCKS  # the put ran
        assert calls == 1
        await wait_pool_full(worker.stub)
    finally:
        prefix.hashes = original
        await worker.close()
