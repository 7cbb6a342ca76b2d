"""The pool of fixed-size KV blocks: reference counts, free queues and the prefix-cache index.

Every block is in exactly one of three states:
    in use          ref_count > 0 (held by one or more sequences)
    free, cached    ref_count == 0 but it holds a full block whose hash is indexed, so a
                    later request with the same prefix can revive it with `touch`
    free, empty     ref_count == 0 and no hash
`allocate` hands out empty blocks first (oldest freed first), then evicts cached blocks in
least-recently-freed order, dropping their hashes. Both kinds count as free.

Block 0 is the null block: never handed out, never freed, never counted as free. The graph
runner points padding rows of the block table at it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

from cleave.errors import ResourceExhausted
from cleave.kv.prefix_hash import BlockHash

NULL_BLOCK_ID = 0


class OutOfBlocksError(ResourceExhausted):
    """The pool has fewer free blocks than an allocation asked for."""


class BlockPool:
    """Reference-counted KV blocks `1..num_blocks-1` plus the reserved null block 0.

    Attributes:
        num_blocks: total blocks including the null block.
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (block 0 is reserved), got {num_blocks}")
        self.num_blocks = num_blocks
        self._ref_counts = [0] * num_blocks
        self._hash_of_block: list[BlockHash | None] = [None] * num_blocks
        self._block_of_hash: dict[BlockHash, int] = {}
        # Insertion order is eviction order; values are unused.
        self._free_empty: OrderedDict[int, None] = OrderedDict.fromkeys(range(1, num_blocks))
        self._free_cached: OrderedDict[int, None] = OrderedDict()

    @property
    def num_usable_blocks(self) -> int:
        """Blocks that can ever be handed out (all but the null block)."""
        return self.num_blocks - 1

    @property
    def num_free_blocks(self) -> int:
        """Blocks `allocate` can hand out now, including evictable cached ones."""
        return len(self._free_empty) + len(self._free_cached)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks (in use or free) whose hash is indexed."""
        return len(self._block_of_hash)

    def ref_count(self, block_id: int) -> int:
        self._check_id(block_id)
        return self._ref_counts[block_id]

    def block_hash(self, block_id: int) -> BlockHash | None:
        self._check_id(block_id)
        return self._hash_of_block[block_id]

    def allocate(self, num_blocks: int) -> list[int]:
        """Take `num_blocks` free blocks (ref_count 1 each), evicting cached ones if needed."""
        if num_blocks < 0:
            raise ValueError(f"cannot allocate {num_blocks} blocks")
        if num_blocks > self.num_free_blocks:
            raise OutOfBlocksError(
                f"asked for {num_blocks} KV blocks but only {self.num_free_blocks} of "
                f"{self.num_usable_blocks} are free; free finished sequences first or start the "
                "worker with more KV blocks (a larger gpu memory fraction or a smaller model)"
            )
        block_ids: list[int] = []
        for _ in range(num_blocks):
            if self._free_empty:
                block_id, _ = self._free_empty.popitem(last=False)
            else:
                block_id, _ = self._free_cached.popitem(last=False)
                self._evict(block_id)
            self._ref_counts[block_id] = 1
            block_ids.append(block_id)
        return block_ids

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one reference from each block; a block reaching 0 joins the back of its queue.

        Blocks freed earlier are evicted earlier, so pass a sequence's blocks tail first to
        keep its shared prefix cached longest.
        """
        for block_id in block_ids:
            self._check_id(block_id)
            if self._ref_counts[block_id] <= 0:
                raise RuntimeError(f"block {block_id} freed more times than it was referenced")
            self._ref_counts[block_id] -= 1
            if self._ref_counts[block_id] == 0:
                if self._hash_of_block[block_id] is None:
                    self._free_empty[block_id] = None
                else:
                    self._free_cached[block_id] = None

    def incref(self, block_ids: Iterable[int]) -> None:
        """Add a reference to blocks that are in use (sharing them with another sequence)."""
        for block_id in block_ids:
            self._check_id(block_id)
            if self._ref_counts[block_id] <= 0:
                raise RuntimeError(f"block {block_id} is free; revive cached blocks with touch()")
            self._ref_counts[block_id] += 1

    def touch(self, block_ids: Iterable[int]) -> None:
        """Add a reference to cached blocks (prefix hits), taking free ones off the free queue."""
        for block_id in block_ids:
            self._check_id(block_id)
            if self._hash_of_block[block_id] is None:
                raise RuntimeError(f"block {block_id} holds no cached prefix and cannot be touched")
            if self._ref_counts[block_id] == 0:
                del self._free_cached[block_id]
            self._ref_counts[block_id] += 1

    def cache_block(self, block_id: int, block_hash: BlockHash) -> bool:
        """Index an in-use full block under `block_hash`.

        Returns False (and leaves the block unindexed) when another block already holds the
        same hash, which happens when two sequences computed the same prefix concurrently.
        """
        self._check_id(block_id)
        if self._ref_counts[block_id] <= 0:
            raise RuntimeError(f"block {block_id} is free; only blocks in use can be cached")
        current = self._hash_of_block[block_id]
        if current is not None:
            if current != block_hash:
                raise RuntimeError(f"block {block_id} is already cached under another hash")
            return True
        if block_hash in self._block_of_hash:
            return False
        self._hash_of_block[block_id] = block_hash
        self._block_of_hash[block_hash] = block_id
        return True

    def lookup(self, block_hash: BlockHash) -> int | None:
        """The block holding `block_hash`, in use or free, or None."""
        return self._block_of_hash.get(block_hash)

    def reset_prefix_cache(self) -> int:
        """Forget every cached hash (e.g. after new weights are loaded); returns how many."""
        count = len(self._block_of_hash)
        for block_id in list(self._block_of_hash.values()):
            self._hash_of_block[block_id] = None
        self._block_of_hash.clear()
        self._free_empty.update(self._free_cached)
        self._free_cached.clear()
        return count

    def _evict(self, block_id: int) -> None:
        block_hash = self._hash_of_block[block_id]
        if block_hash is not None:
            del self._block_of_hash[block_hash]
            self._hash_of_block[block_id] = None

    def _check_id(self, block_id: int) -> None:
        if not 0 < block_id < self.num_blocks:
            raise ValueError(f"block id {block_id} is outside 1..{self.num_blocks - 1}")
