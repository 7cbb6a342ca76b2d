"""KVCacheManager.drop_outside_window: blocks behind a sliding window go back to the pool."""

import pytest

from cleave.kv.manager import KVCacheManager

BLOCK = 4
WINDOW = 12
BOUND = -(-WINDOW // BLOCK) + 1  # blocks a sequence holds at most: the window's, plus a partial one


def make(num_blocks=21, window=WINDOW, **kwargs):
    return KVCacheManager(num_blocks=num_blocks, block_size=BLOCK, sliding_window=window, **kwargs)


def decode(kv, seq_id, tokens, num_steps):
    """`num_steps` decode steps the way the scheduler runs them: a slot for the next token,
    its KV 'computed', then the blocks behind the window dropped. Returns the most blocks held."""
    most = 0
    for _ in range(num_steps):
        assert kv.allocate_slots(seq_id, 1)
        tokens.append(len(tokens) % 50)
        most = max(most, held(kv, seq_id))
        kv.cache_full_blocks(seq_id, tokens)
        kv.drop_outside_window(seq_id, len(tokens))
    return most


def held(kv, seq_id):
    return sum(1 for block_id in kv.block_table(seq_id) if block_id != 0)


def test_long_generation_holds_a_bounded_number_of_blocks():
    kv = make()
    tokens = list(range(10))
    assert kv.allocate_slots("a", len(tokens))
    # 210 tokens would take 53 blocks; the pool has 20.
    assert decode(kv, "a", tokens, 200) == BOUND
    table = kv.block_table("a")
    assert len(table) == kv.num_blocks_for(210)  # position // block_size still indexes it
    first_seen = (210 - WINDOW + 1) // BLOCK  # the next query (position 210) sees 199..210
    assert table[:first_seen] == [0] * first_seen and 0 not in table[first_seen:]
    assert kv.num_free_blocks == kv.num_usable_blocks - held(kv, "a")
    kv.free("a")
    assert kv.num_free_blocks == kv.num_usable_blocks


def test_drop_releases_exactly_the_blocks_no_later_query_sees():
    kv = make(enable_prefix_caching=False)
    assert kv.allocate_slots("a", 15)  # positions 0..14 in blocks 1..4
    before = kv.block_table_view("a")
    # A query at 14 sees 3..14: block 0 (positions 0..3) is still needed for position 3.
    assert kv.drop_outside_window("a", 14) == 0
    assert kv.block_table_view("a") is before
    free = kv.num_free_blocks
    # A query at 15 sees 4..15: block 0 is out of every later window.
    assert kv.drop_outside_window("a", 15) == 1
    assert kv.block_table("a") == [0, 2, 3, 4]
    assert kv.block_table_view("a") is not before  # replaced, so holders of the old one can tell
    assert kv.num_free_blocks == free + 1 and kv.pool.ref_count(1) == 0
    assert kv.drop_outside_window("a", 15) == 0  # idempotent
    with pytest.raises(ValueError, match="position 16"):
        kv.drop_outside_window("a", 16)  # no slot for position 15 yet
    assert kv.drop_outside_window("unknown", 15) == 0


def test_forks_release_one_reference_each():
    kv = make(window=4, enable_prefix_caching=False)
    assert kv.allocate_slots("p", 10)  # blocks 1, 2 full, 3 holds 2 tokens
    kv.fork("p", "c")
    assert kv.allocate_slots("p", 1)  # copy-on-write of the shared partial block 3 into 4
    assert kv.take_pending_copies() == [(3, 4)]
    free = kv.num_free_blocks
    assert kv.drop_outside_window("p", 11) == 2  # a query at 11 sees 8..11: blocks 1 and 2 go
    assert kv.block_table("p") == [0, 0, 4]
    assert kv.pool.ref_count(1) == kv.pool.ref_count(2) == 1  # the child still reads them
    assert kv.num_free_blocks == free
    assert kv.allocate_slots("c", 1)  # block 3 is the child's alone now: no copy
    assert kv.take_pending_copies() == [] and kv.block_table("c") == [1, 2, 3]
    assert kv.drop_outside_window("c", 11) == 2
    assert kv.num_free_blocks == free + 2
    kv.fork("c", "g")  # a fork of a sequence with dropped blocks shares only what it holds
    assert kv.block_table("g") == [0, 0, 3] and kv.pool.ref_count(3) == 2
    for seq_id in ("p", "c", "g"):
        kv.free(seq_id)
    assert kv.num_free_blocks == kv.num_usable_blocks


def test_dropped_cached_blocks_stay_hittable():
    kv = make()
    prompt = list(range(100, 110))
    tokens = list(prompt)
    assert kv.allocate_slots("a", len(tokens))
    kv.cache_full_blocks("a", tokens)
    decode(kv, "a", tokens, 30)  # 40 tokens: blocks 0..6 dropped (first window position 29)
    assert kv.block_table("a")[:2] == [0, 0]
    hit = kv.get_computed_blocks("b", prompt + [1, 2, 3])
    assert hit.num_computed_tokens == 8 and 0 not in hit.block_ids
    assert kv.allocate_slots("b", 5, hit)
    table = kv.block_table("b")
    assert table[:2] == hit.block_ids and 0 not in table
    kv.free("a")
    kv.free("b")
    assert kv.num_free_blocks == kv.num_usable_blocks


def test_blocks_dropped_before_they_were_indexed_are_skipped():
    kv = make()
    tokens = list(range(20))
    assert kv.allocate_slots("a", 20)
    assert kv.drop_outside_window("a", 20) == 2  # a query at 20 sees 9..20
    kv.cache_full_blocks("a", tokens)  # only the blocks it still holds are indexed
    assert kv.pool.num_cached_blocks == 3
    kv.free("a")
    assert kv.num_free_blocks == kv.num_usable_blocks


def test_full_attention_never_drops():
    kv = make(window=None)
    tokens = list(range(10))
    assert kv.allocate_slots("a", len(tokens))
    assert decode(kv, "a", tokens, 30) == 10
    assert 0 not in kv.block_table("a")
    kv.free("a")
    assert kv.num_free_blocks == kv.num_usable_blocks


def test_window_must_be_positive():
    with pytest.raises(ValueError, match="sliding_window"):
        make(window=0)
