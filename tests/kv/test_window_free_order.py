"""KVCacheManager.drop_outside_window frees the blocks it drops tail first, so the pool,
which evicts cached blocks in the order they were freed, evicts a dropped prefix's first
block last: the block every later prefix hit starts with."""

from cleave.kv.manager import KVCacheManager

BLOCK = 4
WINDOW = 4


def make(num_blocks: int) -> KVCacheManager:
    return KVCacheManager(num_blocks=num_blocks, block_size=BLOCK, sliding_window=WINDOW)


def test_blocks_dropped_together_are_evicted_last_block_first():
    kv = make(num_blocks=5)  # usable 1..4
    tokens = list(range(100, 112))  # three full blocks
    assert kv.allocate_slots("a", len(tokens))
    kv.cache_full_blocks("a", tokens)
    assert kv.block_table("a") == [1, 2, 3]
    # A query at 11 sees 8..11: blocks 1 and 2 (positions 0..7) go at once, still cached.
    assert kv.drop_outside_window("a", 11) == 2
    assert kv.block_table("a") == [0, 0, 3]
    assert kv.pool.num_cached_blocks == 3
    # Two blocks for another sequence: the empty block 4, then one cached block is evicted.
    assert kv.allocate_slots("b", 2 * BLOCK)
    assert kv.block_table("b") == [4, 2]  # the second block went, not the first
    assert kv.get_computed_blocks("c", tokens[:BLOCK] + [0])[:2] == ([1], BLOCK)
    assert kv.get_computed_blocks("d", tokens[: 2 * BLOCK] + [0])[:2] == ([1], BLOCK)
