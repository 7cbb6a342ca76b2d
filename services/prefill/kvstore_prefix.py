"""A prefill worker's use of the kvstore: pull a cached prompt prefix into the engine's
prefix cache before the prefill, push the prompt's new full blocks after it (gathered to
host memory, then put, off the request's critical path, one put at a time).

Only blocks seen before are pushed: the store pays off for prefixes that repeat (a system
prompt, a conversation's history), and pushing every prompt costs the worker's host time
(device-to-host copy, encoding, gRPC writes on the engine's interpreter) on every request:
measured on an H200 under 50 streaming users, the put path took more of the prefill
process's samples than the model forward, and the prompts queued behind it. So a block goes
to the store the second time this worker computes its chained hash (a bounded memory of the
hashes it computed, `SEEN_CAPACITY`); since hashes chain, that is a prefix that repeated.

Which leading blocks the store holds comes from the client's index of the store (`start`
subscribes it to the store's Watch stream), with no round trip: nearly every prompt misses,
and a Lookup on each would put a store round trip before every prefill. The index is a hint:
a block evicted a moment ago makes the Get return fewer blocks (the prompt computes the
rest), one stored a moment ago is a missed reuse. Until the index is live (start-up, after
its stream broke) a fetch asks the store (Lookup), as it always did.

On the request's path the store is an optimisation, so it gets short deadlines (a Lookup
`LOOKUP_TIMEOUT_S`; a Get that plus its bytes at `GET_MIN_BYTES_PER_S`) rather than the
client's 30 s: a hung or overloaded store would otherwise hold every prefill that asks it
(and the decode worker's reservation for it) until then. A fetch that fails or times out
makes the worker skip the store for `SKIP_AFTER_FAILURE_S` (those prompts are computed), so
a hung store costs one short wait per period, not one per request.

Short prefixes stay out of the store both ways (`min_prefix_tokens`): a fetch costs a lookup,
a wait for the engine thread's next step boundary (to ask its prefix cache what
it holds) and a Get, which is more than computing a few blocks; chat prompts that share
only their template's first block would otherwise pay it on every request. A fetch skips
that engine round trip for blocks this worker computed lately (its memory of hashes):
those are most likely still in its prefix cache, where the scheduler finds them anyway,
and if they were evicted the prompt is computed, as on any miss.

Block hashes are the engine's own (`block_hashes` under the engine's KV namespace and the
request's cache salt, which `PrefixFetch` carries from the lookup to the put), so a
block fetched from the store and registered in the engine's prefix cache is found by the
scheduler like any locally computed block: those tokens are not recomputed. The fetched
blocks are held (`engine.handoff.hold_prefix`) until the prefill has taken them over; the
backend then lets go of the hold (`release_hold`, on every path), and they stay cached.

A cache that pairs window layers with full ones (gpt-oss, `cleave.kv.groups`) keeps a
block's KV in two pages, and the store keeps them under two keys, as the engine's prefix
cache does: the full page under the block's hash, the window page under its window hash
(`handoff.window_page_hashes`). A prefix of m blocks is usable when the store holds their
full pages and the window pages a query after them sees (blocks num_unseen_pages(m) .. m-1);
a fetch takes the longest such prefix, and both kinds of page in one Get, all or nothing.
The prompt's own table has dropped most window pages by the time it is put (its prefill
moved past them), so a put copies from the prefix cache instead (`handoff.hold_cached`):
the full pages of the repeated prefix and the window pages in view at its end.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from collections import OrderedDict
from dataclasses import dataclass, field

import grpc
import torch

from cleave.engine.async_engine import AsyncEngine
from cleave.engine.llm_engine import LLMEngine
from cleave.transfer import KVStoreClient, gather_blocks_to_host, scatter_blocks
from services.prefill.cleanup import run_to_end

@dataclass(frozen=True)
class PrefixFetch:
    """What a lookup found: blocks in the store, and those loaded into the engine."""

    num_store_blocks: int  # leading prompt blocks the store holds
    num_loaded_blocks: int  # of those, blocks copied into the engine (not already cached)
    # chained hashes of the prompt's full blocks, when the lookup computed them (the put
    # after the prefill reuses them instead of hashing the prompt again)
    hashes: tuple[bytes, ...] | None = None
    cache_salt: str = ""  # the request's: every hash of its prompt is taken under it


@dataclass(frozen=True)
class StorePayload:
    """Prompt blocks on their way to the store, already in host memory."""

    hashes: list[bytes]  # chained hashes of the blocks, in prompt order
    blocks: torch.Tensor  # [n, L, 2, BS, Hkv, D] on the CPU
    parent_hash: bytes  # hash of the block before the first one (b"" at the prompt start)
    # a paired cache's window pages (consecutive blocks'), under their window hashes
    window_hashes: list[bytes] = field(default_factory=list)
    window_blocks: torch.Tensor | None = None  # [w, L, 2, BS, Hkv, D] on the CPU


LOOKUP_TIMEOUT_S = 1.0  # a Lookup is one small message each way: a store that takes longer is not well
GET_TIMEOUT_S = 1.0  # a Get's deadline: this plus its blocks' bytes at GET_MIN_BYTES_PER_S
GET_MIN_BYTES_PER_S = 100e6  # far below loopback or a data-centre link: only a stalled store misses it
SKIP_AFTER_FAILURE_S = 5.0  # after a failed fetch, prompts are computed without asking the store this long
SEEN_CAPACITY = 1 << 18  # block hashes remembered (32 bytes each: ~8 MB with the dict)
DEFAULT_MIN_PREFIX_TOKENS = 256


class KVStorePrefix:
    """Prefix reuse through a kvstore for one engine."""

    def __init__(self, client: KVStoreClient, engine: LLMEngine, async_engine: AsyncEngine,
                 min_prefix_tokens: int = DEFAULT_MIN_PREFIX_TOKENS) -> None:
        self.client = client
        self.engine = engine
        self.async_engine = async_engine
        self.block_size = engine.handoff.block_size
        self.paired = engine.handoff.pairs_window_pages  # two pages (two keys) per block
        # blocks a fetch must be able to load, and a put to send, to be worth its round trips
        self.min_blocks = max(1, -(-min_prefix_tokens // self.block_size))
        self._stream: torch.cuda.Stream | None = None
        self._skip_until = 0.0  # time.monotonic() before which fetches do not ask the store
        self._put_turn = asyncio.Lock()  # one put stream at a time, in arrival order (FIFO)
        self._seen: OrderedDict[bytes, None] = OrderedDict()  # block hashes computed here, LRU

    async def start(self) -> None:
        """Follow the store's blocks (`KVStoreClient.watch`): from then on a fetch finds
        the stored prefix without a Lookup round trip. Call once the client is connected."""
        await self.client.watch()

    async def num_stored(self, hashes: Sequence[bytes]) -> int:
        """How many leading blocks of the chain the store holds (in a paired cache: with the
        window pages in view after them): from the client's index while it is live, else by
        a Lookup (a paired cache's second Lookup tries the longest such prefix only)."""
        index = self.client.index
        num_full = (index.num_leading(hashes) if index.is_live
                    else await self.client.lookup(list(hashes), LOOKUP_TIMEOUT_S))
        if not self.paired or num_full == 0:
            return num_full
        window = self.engine.handoff.window_page_hashes(hashes[:num_full])
        if not index.is_live:
            first = self.first_window_page(num_full)
            found = await self.client.lookup(window[first:], LOOKUP_TIMEOUT_S)
            return num_full if found == num_full - first else 0
        last_missing = -1  # the last block before `num_hit` whose window page the store lacks
        missing_before = []
        for position, key in enumerate(window):
            if key not in index:
                last_missing = position
            missing_before.append(last_missing)
        for num_hit in range(num_full, 0, -1):
            if missing_before[num_hit - 1] < self.first_window_page(num_hit):
                return num_hit
        return 0

    def first_window_page(self, num_blocks: int) -> int:
        """The first block whose window page a query after `num_blocks` blocks sees (0 for
        a cache without window pages)."""
        return self.engine.handoff.num_unseen_pages(num_blocks * self.block_size)

    def _gather_stream(self) -> torch.cuda.Stream | None:
        """The side stream host copies run on (None on CPU)."""
        cache = self.engine.kv_cache
        if cache.is_cuda and self._stream is None:
            self._stream = torch.cuda.Stream(cache.device)
        return self._stream

    def hashes(self, prompt: Sequence[int], cache_salt: str = "") -> list[bytes]:
        """Chained hashes of the prompt's full blocks under the request's cache salt."""
        return self.engine.handoff.block_hashes(prompt, cache_salt)

    async def fetch(self, request_id: str, prompt: Sequence[int], cache_salt: str = "") -> PrefixFetch:
        """Load the stored prefix that the engine does not hold yet into its prefix cache.
        At most len(prompt) - 1 tokens: the last prompt token always runs for the logits.
        Blocks may stay held for the request even when none were loaded: the caller releases
        the hold (`engine.handoff.release_hold`) after the prefill, on every path. Nothing
        is asked of a store that failed a fetch less than `SKIP_AFTER_FAILURE_S` ago; a store
        call that fails raises (grpc.aio.AioRpcError) and starts that period."""
        if time.monotonic() < self._skip_until:
            return PrefixFetch(0, 0, cache_salt=cache_salt)
        try:
            return await self._fetch(request_id, prompt, cache_salt)
        except grpc.aio.AioRpcError:
            self._skip_until = time.monotonic() + SKIP_AFTER_FAILURE_S
            raise

    async def _fetch(self, request_id: str, prompt: Sequence[int], cache_salt: str) -> PrefixFetch:
        usable = (len(prompt) - 1) // self.block_size
        if usable < self.min_blocks:
            return PrefixFetch(0, 0, cache_salt=cache_salt)  # too short to be worth a lookup
        all_hashes = tuple(self.hashes(prompt, cache_salt))
        hashes = all_hashes[:usable]
        num_hit = await self.num_stored(hashes)
        if num_hit - self.num_seen(hashes[:num_hit]) < self.min_blocks:
            return PrefixFetch(num_hit, 0, all_hashes, cache_salt)  # little the engine would not compute or hold
        num_local = await self.async_engine.call(lambda e: e.handoff.num_cached_blocks(list(hashes[:num_hit])))
        if num_local >= num_hit:
            return PrefixFetch(num_hit, 0, all_hashes, cache_salt)
        keys = list(hashes[num_local:num_hit])
        first_window = max(num_local, self.first_window_page(num_hit))  # window pages the engine lacks
        if self.paired:
            keys += self.engine.handoff.window_page_hashes(hashes[first_window:num_hit])
        timeout_s = GET_TIMEOUT_S + len(keys) * self.client.block_num_bytes / GET_MIN_BYTES_PER_S
        got = await self.client.get(keys, timeout_s)  # [n, L, 2, BS, Hkv, D]
        if self.paired and got.shape[0] < len(keys):
            return PrefixFetch(num_hit, 0, all_hashes, cache_salt)  # a page left the store meanwhile: computed here
        num_hit = num_local + min(got.shape[0], num_hit - num_local)  # fewer when blocks left the store meanwhile
        if got.shape[0] == 0:
            return PrefixFetch(num_hit, 0, all_hashes, cache_salt)
        blocks, window_blocks = got[: num_hit - num_local], got[num_hit - num_local :]
        tokens = list(prompt[: num_hit * self.block_size])

        def load(e: LLMEngine) -> int:
            hold = e.handoff.hold_prefix(request_id, tokens, cache_salt)
            if hold is None:
                return 0  # no room: the engine computes these tokens itself
            if hold.num_cached_blocks < num_local:  # local blocks were evicted meanwhile: no payload for them
                e.handoff.release_hold(request_id)
                return 0
            scatter_blocks(e.kv_cache, hold.new_block_ids, blocks[hold.num_cached_blocks - num_local :])
            if hold.new_window_page_ids:
                scatter_blocks(e.kv_cache, hold.new_window_page_ids, window_blocks[hold.first_new_window_page - first_window :])
            e.handoff.publish_hold(request_id, tokens, cache_salt)
            return len(hold.new_block_ids)

        loaded = await self.async_engine.call(load)
        return PrefixFetch(num_hit, loaded, all_hashes, cache_salt)

    async def gather(self, request_id: str, prompt: Sequence[int], block_table: Sequence[int],
                     fetch: PrefixFetch) -> StorePayload | None:
        """Copy the prompt's full blocks after the `fetch.num_store_blocks` already in the
        store to host memory; None when there are none. `block_table` holds the prompt's KV,
        which may be freed once this returns (a paired cache's pages come from the prefix
        cache instead: `gather_cached`)."""
        num_stored = fetch.num_store_blocks
        hashes = list(fetch.hashes) if fetch.hashes is not None else self.hashes(prompt, fetch.cache_salt)
        num_repeated = self.repeated(hashes)
        if num_repeated - num_stored < self.min_blocks:
            return None
        hashes = hashes[:num_repeated]
        if self.paired:
            return await self.gather_cached(request_id, prompt, hashes, num_stored, fetch.cache_salt)
        ids = list(block_table[num_stored:num_repeated])
        blocks = await self._copy_to_host(ids)
        parent = hashes[num_stored - 1] if num_stored else b""
        return StorePayload(hashes[num_stored:], blocks, parent)

    async def gather_cached(self, request_id: str, prompt: Sequence[int], hashes: list[bytes],
                            num_stored: int, cache_salt: str = "") -> StorePayload | None:
        """A paired cache's pages for the prompt's blocks `hashes` (the store holds the first
        `num_stored` with their window pages), held out of the prefix cache while they are
        copied: the full pages the store lacks and the window pages in view after the
        longest prefix still cached. None when that adds fewer than `min_blocks` blocks."""
        tokens = list(prompt[: len(hashes) * self.block_size])
        try:
            pages = await self.async_engine.call(lambda e: e.handoff.hold_cached(request_id, tokens, cache_salt))
            if pages.num_blocks - num_stored < self.min_blocks:
                return None
            hashes = hashes[: pages.num_blocks]
            index = self.client.index
            first_full = max(num_stored, index.num_leading(hashes)) if index.is_live else num_stored
            ids = pages.block_ids[first_full:] + pages.window_page_ids
            blocks = await self._copy_to_host(ids)
        finally:  # also when the hold's call was cut short after it ran: releases are no-ops without one
            await run_to_end(self.async_engine.call(lambda e: e.handoff.release_cached(request_id)))
        num_full = pages.num_blocks - first_full
        return StorePayload(
            hashes[first_full:], blocks[:num_full], hashes[first_full - 1] if first_full else b"",
            self.engine.handoff.window_page_hashes(hashes[pages.first_window_page :]), blocks[num_full:],
        )

    async def _copy_to_host(self, block_ids: list[int]) -> torch.Tensor:
        """Blocks of the engine's cache in host memory, [n, L, 2, BS, Hkv, D]. The blocks are
        held (nobody writes them), so the copy reads them beside the engine's steps, on a
        thread and a stream of its own, instead of stalling the step thread."""
        return await asyncio.to_thread(gather_blocks_to_host, self.engine.kv_cache, block_ids, self._gather_stream())

    def num_seen(self, hashes: Sequence[bytes]) -> int:
        """How many leading blocks of `hashes` this worker computed lately (remembers nothing)."""
        num_seen = 0
        while num_seen < len(hashes) and hashes[num_seen] in self._seen:
            num_seen += 1
        return num_seen

    def remember(self, prompt: Sequence[int], fetch: PrefixFetch) -> None:
        """Note a prompt this worker computed without putting it (see `repeated`)."""
        self.repeated(list(fetch.hashes) if fetch.hashes is not None else self.hashes(prompt, fetch.cache_salt))

    def repeated(self, hashes: Sequence[bytes]) -> int:
        """How many leading blocks of a prompt this worker computed before; then remembers
        all of them."""
        num_repeated = self.num_seen(hashes)
        for block_hash in hashes:
            self._seen[block_hash] = None
            self._seen.move_to_end(block_hash)
        while len(self._seen) > SEEN_CAPACITY:
            self._seen.popitem(last=False)
        return num_repeated

    async def put(self, payload: StorePayload) -> int:
        """Send gathered blocks to the store; returns how many it newly keeps.

        Puts go one at a time: the store serves every call on one event loop, so N puts in
        flight put every request's Lookup (on the prefill's critical path) behind N streams
        of megabytes, and their encoding threads share this worker's GIL with the engine
        thread. One stream moves the same bytes per second."""
        async with self._put_turn:
            result = await self.client.put(payload.hashes, payload.blocks, parent_hash=payload.parent_hash)
            num_stored = result.num_stored
            if payload.window_blocks is not None and payload.window_hashes:
                num_stored += (await self.client.put(payload.window_hashes, payload.window_blocks)).num_stored
        return num_stored

