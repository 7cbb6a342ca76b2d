import pytest

from cleave.kv.block_pool import BlockPool, OutOfBlocksError


def test_allocate_skips_null_block_and_counts_free():
    pool = BlockPool(6)
    assert pool.num_free_blocks == 5
    assert pool.allocate(3) == [1, 2, 3]
    assert pool.num_free_blocks == 2
    assert [pool.ref_count(b) for b in (1, 2, 3, 4)] == [1, 1, 1, 0]


def test_allocate_too_many_raises_without_side_effects():
    pool = BlockPool(4)
    pool.allocate(2)
    with pytest.raises(OutOfBlocksError, match="only 1 of 3 are free"):
        pool.allocate(2)
    assert pool.num_free_blocks == 1
    assert pool.allocate(1) == [3]


def test_ref_counts_and_double_free():
    pool = BlockPool(4)
    (block,) = pool.allocate(1)
    pool.incref([block])
    pool.free([block])
    assert pool.ref_count(block) == 1 and pool.num_free_blocks == 2
    pool.free([block])
    assert pool.ref_count(block) == 0 and pool.num_free_blocks == 3
    with pytest.raises(RuntimeError):
        pool.free([block])
    with pytest.raises(RuntimeError):
        pool.incref([block])
    with pytest.raises(ValueError):
        pool.free([0])


def test_freed_empty_blocks_are_reused_oldest_first():
    pool = BlockPool(5)
    pool.allocate(4)
    pool.free([3, 1])
    assert pool.allocate(2) == [3, 1]


def test_cached_blocks_survive_free_and_are_evicted_last_and_lru():
    pool = BlockPool(6)  # usable 1..5
    blocks = pool.allocate(5)
    for block_id, tag in zip(blocks[:3], b"abc"):
        assert pool.cache_block(block_id, bytes([tag]) * 32)
    pool.free([2, 1, 3, 4, 5])  # cached free order: 2, 1, 3; empty: 4, 5
    assert pool.num_free_blocks == 5
    assert pool.lookup(b"a" * 32) == 1
    # Empty blocks go first, then cached ones least recently freed first.
    assert pool.allocate(3) == [4, 5, 2]
    assert pool.lookup(b"b" * 32) is None  # block 2 was evicted with its hash
    assert pool.lookup(b"a" * 32) == 1
    assert pool.num_cached_blocks == 2


def test_touch_revives_cached_block_and_duplicate_hash_is_refused():
    pool = BlockPool(4)
    first, second = pool.allocate(2)
    assert pool.cache_block(first, b"x" * 32)
    assert not pool.cache_block(second, b"x" * 32)
    assert pool.block_hash(second) is None
    pool.free([first, second])
    assert pool.num_free_blocks == 3
    pool.touch([first])
    assert pool.ref_count(first) == 1 and pool.num_free_blocks == 2
    assert pool.allocate(2) == [3, second]  # the revived block is not handed out
    with pytest.raises(RuntimeError):
        pool.touch([second])


def test_reset_prefix_cache():
    pool = BlockPool(3)
    (block,) = pool.allocate(1)
    pool.cache_block(block, b"y" * 32)
    pool.free([block])
    assert pool.reset_prefix_cache() == 1
    assert pool.lookup(b"y" * 32) is None and pool.num_free_blocks == 2
