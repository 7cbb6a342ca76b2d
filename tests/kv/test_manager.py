import pytest

from cleave.kv.block_pool import OutOfBlocksError
from cleave.kv.manager import KVCacheManager
from cleave.kv.prefix_hash import block_hashes

BLOCK = 4


def make(num_blocks=11, **kwargs):
    return KVCacheManager(num_blocks=num_blocks, block_size=BLOCK, **kwargs)


def run_prompt(kv, seq_id, tokens):
    """Allocate and 'compute' a whole prompt the way the scheduler does."""
    hit = kv.get_computed_blocks(seq_id, tokens)
    assert kv.allocate_slots(seq_id, len(tokens) - hit.num_computed_tokens, hit)
    kv.cache_full_blocks(seq_id, tokens)
    return hit


def test_allocate_grows_table_block_by_block():
    kv = make()
    assert kv.allocate_slots("a", 5)
    assert kv.block_table("a") == [1, 2]
    assert kv.allocate_slots("a", 3)  # 8 tokens still fit in 2 blocks
    assert kv.block_table("a") == [1, 2]
    assert kv.allocate_slots("a", 1)
    assert kv.block_table("a") == [1, 2, 3]
    assert kv.num_tokens("a") == 9
    assert kv.num_free_blocks == 7
    assert kv.usage == pytest.approx(0.3)


def test_allocate_failure_changes_nothing():
    kv = make(num_blocks=4)
    assert kv.allocate_slots("a", 8)
    assert not kv.can_allocate("b", 5)
    assert not kv.allocate_slots("b", 5)
    assert kv.block_table("b") == [] and kv.num_free_blocks == 1
    assert kv.allocate_slots("b", 4)
    assert kv.block_table("b") == [3]


def test_prefix_hit_reuses_full_blocks_and_leaves_one_token():
    kv = make()
    prompt = list(range(100, 110))  # 2 full blocks + 2 tokens
    run_prompt(kv, "a", prompt)
    assert kv.block_table("a") == [1, 2, 3]
    hit = kv.get_computed_blocks("b", prompt + [7, 7])
    assert hit[:2] == ([1, 2], 8)
    assert kv.allocate_slots("b", 4, hit)
    assert kv.block_table("b") == [1, 2, 4]
    assert kv.pool.ref_count(1) == 2 and kv.pool.ref_count(3) == 1
    # A prompt that is exactly two full blocks reuses only one: the last token is recomputed.
    assert kv.get_computed_blocks("c", prompt[:8])[:2] == ([1], 4)
    # A different first block shares nothing, even with an equal second block.
    assert kv.get_computed_blocks("d", [0, 0, 0, 0] + prompt[4:])[:2] == ([], 0)


def test_freed_cached_blocks_are_hit_until_evicted():
    kv = make(num_blocks=5)  # usable 1..4
    prompt = list(range(9))
    run_prompt(kv, "a", prompt)
    kv.free("a")
    assert kv.num_free_blocks == 4
    hit = kv.get_computed_blocks("b", prompt)
    assert hit[:2] == ([1, 2], 8)
    assert kv.allocate_slots("b", 1, hit)
    assert kv.block_table("b") == [1, 2, 4]  # block 3 (partial, unhashed) was freed first
    kv.free("b")
    # Empty blocks go first (3 was freed before 4), then cached ones: b freed 2 before 1.
    assert kv.allocate_slots("c", 12)
    assert kv.block_table("c") == [3, 4, 2]
    assert kv.get_computed_blocks("d", prompt)[:2] == ([1], 4)


def test_revived_cached_blocks_count_against_free_space():
    kv = make(num_blocks=4)  # usable 1..3
    prompt = list(range(9))
    run_prompt(kv, "a", prompt)
    kv.free("a")
    hit = kv.get_computed_blocks("b", prompt)
    assert hit.block_ids == [1, 2]
    # Reviving 1 and 2 leaves one free block: 1 + 4 new tokens need 2.
    assert not kv.can_allocate("b", 5, hit)
    assert not kv.allocate_slots("b", 5, hit)
    assert kv.pool.ref_count(1) == 0 and kv.num_free_blocks == 3
    assert kv.allocate_slots("b", 1, hit)


def test_hashes_match_prefix_hash_module_and_namespace_isolates():
    kv = make(namespace=b"model-a")
    prompt = list(range(8))
    run_prompt(kv, "a", prompt)
    assert kv.pool.block_hash(1) == block_hashes(prompt, BLOCK, b"model-a")[0]
    other = KVCacheManager(11, BLOCK, namespace=b"model-b")
    assert other.pool.lookup(kv.pool.block_hash(1)) is None


def test_prefix_caching_disabled():
    kv = make(enable_prefix_caching=False)
    run_prompt(kv, "a", list(range(9)))
    assert kv.pool.num_cached_blocks == 0
    assert kv.get_computed_blocks("b", list(range(9)))[:2] == ([], 0)


def test_fork_shares_blocks_and_copies_on_write():
    kv = make()
    prompt = list(range(6))  # block 1 full, block 2 holds 2 tokens
    run_prompt(kv, "p", prompt)
    kv.fork("p", "c")
    assert kv.block_table("c") == [1, 2]
    assert kv.pool.ref_count(1) == 2 and kv.pool.ref_count(2) == 2
    # The child writes token 6 into the shared partial block: it gets block 3, copied from 2.
    assert kv.allocate_slots("c", 1)
    assert kv.block_table("c") == [1, 3]
    assert kv.take_pending_copies() == [(2, 3)]
    assert kv.take_pending_copies() == []
    # The parent now owns block 2 alone and writes in place.
    assert kv.allocate_slots("p", 1)
    assert kv.block_table("p") == [1, 2]
    assert kv.take_pending_copies() == []
    kv.free("p")
    kv.free("c")
    assert kv.num_free_blocks == 10


def test_fork_at_block_boundary_needs_no_copy():
    kv = make()
    run_prompt(kv, "p", list(range(8)))
    kv.fork("p", "c")
    assert kv.allocate_slots("c", 1)
    assert kv.block_table("c") == [1, 2, 3]
    assert kv.take_pending_copies() == []


def test_copy_on_write_needs_a_free_block():
    kv = make(num_blocks=3)  # usable 1, 2
    run_prompt(kv, "p", list(range(6)))
    kv.fork("p", "c")
    assert not kv.allocate_slots("c", 1)
    assert kv.block_table("c") == [1, 2] and kv.take_pending_copies() == []


def test_freeing_the_copy_destination_drops_the_pending_copy():
    kv = make()
    run_prompt(kv, "p", list(range(6)))
    kv.fork("p", "c")
    assert kv.allocate_slots("c", 1)
    kv.free("c")
    assert kv.take_pending_copies() == []
    assert kv.block_table("p") == [1, 2] and kv.pool.ref_count(2) == 1


def test_reserve_and_release():
    kv = make(num_blocks=5)
    assert kv.reserve("remote", 9) == [1, 2, 3]
    with pytest.raises(OutOfBlocksError, match="needs 2 KV blocks but 1 are free"):
        kv.reserve("other", 5)
    assert kv.block_table("other") == []
    with pytest.raises(ValueError):
        kv.reserve("remote", 1)
    kv.release("remote")
    assert kv.num_free_blocks == 4


def test_free_unknown_sequence_is_a_no_op_and_lookup_state_is_dropped():
    kv = make()
    kv.free("nobody")
    kv.get_computed_blocks("w", list(range(9)))
    kv.free("w")
    assert kv.num_free_blocks == 10 and not kv.has("w")
