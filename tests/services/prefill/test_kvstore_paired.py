"""The kvstore with a cache that pairs window layers (gpt-oss): a prefill worker puts a
repeated prefix's full pages and the window pages in view at its end (which its own table
had dropped by then), and a cold worker fetches both and computes only the rest, to the
same first token and logprobs as a worker that computed everything; a prefix whose window
pages the store lacks is not fetched."""

from __future__ import annotations

from pathlib import Path

import pytest

from cleave.proto.cleave.v1 import prefill_pb2 as p
from cleave.rpc.prefill_call import prefill_response
from cleave.testing.tiny_models import write_tiny_checkpoint
from tests.worker.cluster import greedy, start_kvstore, start_prefill, wait_pool_full

WINDOW = 6  # a query sees its last 6 positions: the window pages of the last two 4-token blocks
LAYER_TYPES = ["sliding_attention", "full_attention", "full_attention", "sliding_attention"]
PREFIX = list(range(40, 56))  # 4 blocks of 4, shared by the prompts
PROMPT = PREFIX + list(range(100, 114))  # 30 tokens: prefilled in chunks of 16, window pages dropped as it goes
OTHER = PREFIX + list(range(300, 311))  # the same 4 blocks, another tail
STORED_PAGES = 4 + 2  # the prefix's full pages, and the window pages of blocks 2 and 3


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("kvstore-paired")
    return write_tiny_checkpoint(root / "gpt-oss", "gpt-oss", seed=21, num_hidden_layers=4,
                                 layer_types=LAYER_TYPES, sliding_window=WINDOW)


@pytest.fixture
async def kvstore():
    store = await start_kvstore()
    yield store
    await store.close()


def request(request_id: str, prompt: list[int], store: bool = False) -> p.PrefillRequest:
    return p.PrefillRequest(request_id=request_id, prompt_token_ids=prompt, sampling=greedy(4, logprobs=3),
                            store_to_kvstore=store)


async def start(checkpoint: Path, kvstore):  # type: ignore[no-untyped-def]
    return await start_prefill(checkpoint, kvstore.server.address, max_num_batched_tokens=16, max_model_len=96)


def assert_same_first_token(warm: p.PrefillResponse, cold: p.PrefillResponse) -> None:
    assert list(warm.first_token_ids) == list(cold.first_token_ids)
    (warm_top,), (cold_top,) = warm.first_token_logprobs, cold.first_token_logprobs
    assert [entry.token_id for entry in warm_top.top] == [entry.token_id for entry in cold_top.top]
    for ours, theirs in zip(warm_top.top, cold_top.top):
        assert ours.logprob == pytest.approx(theirs.logprob, abs=1e-5)


@pytest.mark.parametrize("index_live", [True, False], ids=["index", "lookup"])
async def test_a_cold_worker_fetches_full_and_window_pages(checkpoint, kvstore, index_live):
    first, second = await start(checkpoint, kvstore), await start(checkpoint, kvstore)
    try:
        assert first.backend.engine.handoff.pairs_window_pages
        store_prefix = first.backend.kvstore
        store_prefix.repeated(store_prefix.hashes(PREFIX))  # seen before: the 4 prefix blocks go to the store
        cold = await prefill_response(first.stub.Prefill(request("a", PROMPT, store=True)))
        assert (cold.num_cached_tokens, cold.num_computed_tokens) == (0, 30)
        assert await first.backend.wait_for_stores(timeout_s=10)
        assert first.backend.counters.num_kvstore_blocks_stored == STORED_PAGES
        await wait_pool_full(first.stub)  # the copy's hold is released too

        fetching = second.backend.kvstore
        hashes = fetching.hashes(PREFIX)
        index = fetching.client.index
        await index.wait_until(lambda i: i.is_live and i.num_leading(hashes) == 4, 30)
        if not index_live:
            index.reset()  # not live until a new snapshot: fetches ask the store
        warm = await prefill_response(second.stub.Prefill(request("b", PROMPT)))
        assert (warm.num_cached_tokens, warm.num_computed_tokens) == (16, 14)
        assert second.backend.counters.num_kvstore_blocks_loaded == 4
        assert_same_first_token(warm, cold)
        await wait_pool_full(second.stub)
    finally:
        for worker in (first, second):
            await worker.close()


async def test_a_prefix_without_its_window_pages_in_the_store_is_computed(checkpoint, kvstore):
    """Only the pages in view at the stored prefix's end are kept: a prompt sharing three of
    its blocks needs the window pages of blocks 1 and 2, which the store lacks."""
    first, second = await start(checkpoint, kvstore), await start(checkpoint, kvstore)
    try:
        store_prefix = first.backend.kvstore
        store_prefix.repeated(store_prefix.hashes(PREFIX))
        await prefill_response(first.stub.Prefill(request("a", PROMPT, store=True)))
        assert await first.backend.wait_for_stores(timeout_s=10)
        fetching = second.backend.kvstore
        hashes = fetching.hashes(PREFIX)
        await fetching.client.index.wait_until(lambda i: i.is_live and i.num_leading(hashes) == 4, 30)
        assert await fetching.num_stored(hashes[:3]) == 0  # full pages stored, window pages not
        shorter = PREFIX[:12] + list(range(500, 510))
        miss = await prefill_response(second.stub.Prefill(request("short", shorter)))
        assert (miss.num_cached_tokens, second.backend.counters.num_kvstore_blocks_loaded) == (0, 0)
        # All 4 blocks: a hit, blocks 0-2 (and their window pages) from this worker's own cache
        # (the shorter prompt computed them), block 3 and its window page from the store.
        other = await prefill_response(second.stub.Prefill(request("other", OTHER)))
        assert (other.num_cached_tokens, second.backend.counters.num_kvstore_blocks_loaded) == (16, 1)
        computed = await prefill_response(first.stub.Prefill(request("computed", OTHER)))  # first holds them itself
        assert computed.num_cached_tokens == 16
        assert_same_first_token(other, computed)
        for worker in (first, second):
            await wait_pool_full(worker.stub)
    finally:
        for worker in (first, second):
            await worker.close()
