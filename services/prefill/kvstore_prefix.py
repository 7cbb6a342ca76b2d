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

Short prefixes stay out of the store both ways (`min_prefix_tokens`): a fetch costs a lookup,
a wait for the engine thread's next step boundary (to ask its prefix cache what
it holds) and a Get, which is more than computing a few blocks; chat prompts that share
only their template's first block would otherwise pay it on every request. A fetch skips
that engine round trip for blocks this worker computed lately (its memory of hashes):
those are most likely still in its prefix cache, where the scheduler finds them anyway,
and if they were evicted the prompt is computed, as on any miss.

Block hashes are the engine's own (`block_hashes` under the engine's KV namespace), so a
block fetched from the store and registered in the engine's prefix cache is found by the
scheduler like any locally computed block: those tokens are not recomputed. The fetched
blocks are held (`engine.handoff.hold_prefix`) until the prefill has taken them over; the
backend then lets go of the hold (`release_hold`, on every path), and they stay cached.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from collections import OrderedDict
from dataclasses import dataclass

import torch

from cleave.engine.async_engine import AsyncEngine
from cleave.engine.llm_engine import LLMEngine
from cleave.transfer import KVStoreClient, gather_blocks_to_host, scatter_blocks

@dataclass(frozen=True)
class PrefixFetch:
    """What a lookup found: blocks in the store, and those loaded into the engine."""

    num_store_blocks: int  # leading prompt blocks the store holds
    num_loaded_blocks: int  # of those, blocks copied into the engine (not already cached)
    # chained hashes of the prompt's full blocks, when the lookup computed them (the put
    # after the prefill reuses them instead of hashing the prompt again)
    hashes: tuple[bytes, ...] | None = None


@dataclass(frozen=True)
class StorePayload:
    """Prompt blocks on their way to the store, already in host memory."""

    hashes: list[bytes]  # chained hashes of the blocks, in prompt order
    blocks: torch.Tensor  # [n, L, 2, BS, Hkv, D] on the CPU
    parent_hash: bytes  # hash of the block before the first one (b"" at the prompt start)


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
        # blocks a fetch must be able to load, and a put to send, to be worth its round trips
        self.min_blocks = max(1, -(-min_prefix_tokens // self.block_size))
        self._stream: torch.cuda.Stream | None = None
        self._put_turn = asyncio.Lock()  # one put stream at a time, in arrival order (FIFO)
        self._seen: OrderedDict[bytes, None] = OrderedDict()  # block hashes computed here, LRU

    async def start(self) -> None:
        """Follow the store's blocks (`KVStoreClient.watch`): from then on a fetch finds
        the stored prefix without a Lookup round trip. Call once the client is connected."""
        await self.client.watch()

    async def num_stored(self, hashes: Sequence[bytes]) -> int:
        """How many leading blocks of the chain the store holds: from the client's index
        while it is live, else by a Lookup."""
        index = self.client.index
        if index.is_live:
            return index.num_leading(hashes)
        return await self.client.lookup(list(hashes))

    def _gather_stream(self) -> torch.cuda.Stream | None:
        """The side stream host copies run on (None on CPU)."""
        cache = self.engine.kv_cache
        if cache.is_cuda and self._stream is None:
            self._stream = torch.cuda.Stream(cache.device)
        return self._stream

    def hashes(self, prompt: Sequence[int]) -> list[bytes]:
        """Chained hashes of the prompt's full blocks."""
        return self.engine.handoff.block_hashes(prompt)

    async def fetch(self, request_id: str, prompt: Sequence[int]) -> PrefixFetch:
        """Load the stored prefix that the engine does not hold yet into its prefix cache.
        At most len(prompt) - 1 tokens: the last prompt token always runs for the logits.
        Blocks may stay held for the request even when none were loaded: the caller releases
        the hold (`engine.handoff.release_hold`) after the prefill, on every path."""
        usable = (len(prompt) - 1) // self.block_size
        if usable < self.min_blocks:
            return PrefixFetch(0, 0)  # too short to be worth a lookup
        all_hashes = tuple(self.hashes(prompt))
        hashes = all_hashes[:usable]
        num_hit = await self.num_stored(hashes)
        if num_hit - self.num_seen(hashes[:num_hit]) < self.min_blocks:
            return PrefixFetch(num_hit, 0, all_hashes)  # little the engine would not compute (or hold) itself
        num_local = await self.async_engine.call(lambda e: e.handoff.num_cached_blocks(list(hashes[:num_hit])))
        if num_local >= num_hit:
            return PrefixFetch(num_hit, 0, all_hashes)
        blocks = await self.client.get(list(hashes[num_local:num_hit]))  # [n, L, 2, BS, Hkv, D]
        num_hit = num_local + blocks.shape[0]  # fewer than asked when blocks left the store meanwhile
        if blocks.shape[0] == 0:
            return PrefixFetch(num_hit, 0, all_hashes)
        tokens = list(prompt[: num_hit * self.block_size])

        def load(e: LLMEngine) -> int:
            hold = e.handoff.hold_prefix(request_id, tokens)
            if hold is None:
                return 0  # no room: the engine computes these tokens itself
            if hold.num_cached_blocks < num_local:  # local blocks were evicted meanwhile: no payload for them
                e.handoff.release_hold(request_id)
                return 0
            scatter_blocks(e.kv_cache, hold.new_block_ids, blocks[hold.num_cached_blocks - num_local :])
            e.handoff.publish_hold(request_id, tokens)
            return len(hold.new_block_ids)

        loaded = await self.async_engine.call(load)
        return PrefixFetch(num_hit, loaded, all_hashes)

    async def gather(self, prompt: Sequence[int], block_table: Sequence[int], fetch: PrefixFetch) -> StorePayload | None:
        """Copy the prompt's full blocks after the `fetch.num_store_blocks` already in the
        store to host memory; None when there are none. `block_table` holds the prompt's KV,
        which may be freed once this returns."""
        num_stored = fetch.num_store_blocks
        hashes = list(fetch.hashes) if fetch.hashes is not None else self.hashes(prompt)
        num_repeated = self.repeated(hashes)
        if num_repeated - num_stored < self.min_blocks:
            return None
        hashes = hashes[:num_repeated]
        ids = list(block_table[num_stored:num_repeated])
        # The blocks are held (nobody writes them), so the copy reads them beside the engine's
        # steps, on a thread and a stream of its own, instead of stalling the step thread.
        blocks = await asyncio.to_thread(gather_blocks_to_host, self.engine.kv_cache, ids, self._gather_stream())
        parent = hashes[num_stored - 1] if num_stored else b""
        return StorePayload(hashes[num_stored:], blocks, parent)

    def num_seen(self, hashes: Sequence[bytes]) -> int:
        """How many leading blocks of `hashes` this worker computed lately (remembers nothing)."""
        num_seen = 0
        while num_seen < len(hashes) and hashes[num_seen] in self._seen:
            num_seen += 1
        return num_seen

    def remember(self, prompt: Sequence[int], fetch: PrefixFetch) -> None:
        """Note a prompt this worker computed without putting it (see `repeated`)."""
        self.repeated(list(fetch.hashes) if fetch.hashes is not None else self.hashes(prompt))

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
        return result.num_stored

