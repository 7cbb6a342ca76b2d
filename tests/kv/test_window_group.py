"""KVCacheManager with a window group: each sequence holds a block table and a window table
over one pool; the window table drops pages behind the window, the block table keeps all."""

import pytest

from cleave.kv.block_pool import NULL_BLOCK_ID, OutOfBlocksError
from cleave.kv.manager import KVCacheManager
from cleave.kv.prefix_hash import block_hashes

BLOCK = 4
WINDOW = 6
BOUND = -(-WINDOW // BLOCK) + 1  # window pages a decoding sequence holds at most


def make(num_blocks=41, **kwargs):
    return KVCacheManager(num_blocks=num_blocks, block_size=BLOCK, sliding_window=WINDOW, window_group=True, **kwargs)


def held(table):
    return sum(1 for block_id in table if block_id != NULL_BLOCK_ID)


def generate(kv, seq_id, tokens, num_steps):
    """Decode steps as the scheduler runs them: a slot each, its KV 'computed', then the
    window table's pages behind the window dropped. Returns the most window pages held."""
    most = 0
    for _ in range(num_steps):
        assert kv.allocate_decode_slots([seq_id]) is not None
        tokens.append(len(tokens) % 50)
        most = max(most, held(kv.window_table_view(seq_id)))
        kv.cache_full_blocks(seq_id, tokens)
        kv.drop_outside_window(seq_id, len(tokens))
    return most


def test_both_tables_grow_together_and_only_the_window_table_drops():
    kv = make()
    assert kv.num_groups == 2 and kv.num_blocks_for(9) == 6
    tokens = list(range(9))
    assert kv.allocate_slots("a", len(tokens))
    assert len(kv.block_table("a")) == len(kv.window_table_view("a")) == 3
    assert not set(kv.block_table("a")) & set(kv.window_table_view("a"))  # pages of their own
    assert kv.num_free_blocks == kv.num_usable_blocks - 6
    assert generate(kv, "a", tokens, 60) == BOUND
    assert len(tokens) == 69
    table, window = kv.block_table("a"), list(kv.window_table_view("a"))
    assert len(table) == len(window) == 18 and NULL_BLOCK_ID not in table
    first_seen = (69 - WINDOW + 1) // BLOCK
    assert window[:first_seen] == [NULL_BLOCK_ID] * first_seen and NULL_BLOCK_ID not in window[first_seen:]
    assert kv.pages("a") == window + table
    assert kv.num_free_blocks == kv.num_usable_blocks - 18 - held(window)
    kv.free("a")
    assert kv.num_free_blocks == kv.num_usable_blocks and kv.window_table_view("a") == ()


def test_decode_slots_need_a_free_page_per_table():
    kv = make(num_blocks=5, enable_prefix_caching=False)  # 4 usable pages
    assert kv.allocate_slots("a", 4) and kv.allocate_slots("b", 4)  # one full block in each table each
    assert kv.num_free_blocks == 0
    assert kv.allocate_decode_slots(["a"]) is None  # the next token needs a page in both tables
    kv.free("b")
    tables = kv.allocate_decode_slots(["a"])
    assert tables is not None and len(tables[0]) == 2 and len(kv.window_table_view("a")) == 2


def test_a_prefix_hit_takes_the_full_pages_and_only_the_window_pages_still_in_view():
    kv = make()
    prompt = list(range(100, 117))  # 17 tokens: 4 full blocks
    assert kv.allocate_slots("a", len(prompt))
    kv.cache_full_blocks("a", prompt)
    hit = kv.get_computed_blocks("b", prompt)
    assert hit.num_computed_tokens == 16 and hit.block_ids == kv.block_table("a")[:4]
    # a query at 16 sees 11..16: blocks 0 and 1 (positions 0..7) are out of view
    assert hit.window_block_ids == (NULL_BLOCK_ID, NULL_BLOCK_ID, *kv.window_table_view("a")[2:4])
    free = kv.num_free_blocks
    assert kv.allocate_slots("b", 1, hit)
    assert kv.num_free_blocks == free - 2  # one new page in each table
    assert list(kv.window_table_view("b"))[:4] == list(hit.window_block_ids)
    kv.free("a")
    kv.free("b")
    assert kv.num_free_blocks == kv.num_usable_blocks


def test_a_hit_shortens_to_the_blocks_whose_window_pages_are_cached():
    kv = make()
    prompt = list(range(200, 213))  # 13 tokens: 3 full blocks
    assert kv.allocate_slots("a", len(prompt))
    kv.cache_full_blocks("a", prompt)
    third_window_page = kv.window_table_view("a")[2]
    kv.free("a")
    kv.pool._evict(third_window_page)  # the window page of block 2 is gone, its full page is not
    assert kv.num_cached_blocks(block_hashes(prompt, BLOCK)) == 2  # what a hit would take, looked up alone
    hit = kv.get_computed_blocks("b", prompt)
    # 3 blocks would need window pages 1 and 2; 2 blocks need pages 0 and 1, still cached
    assert hit.num_computed_tokens == 8 and hit.window_block_ids[0] != NULL_BLOCK_ID
    assert kv.allocate_slots("b", len(prompt) - 8, hit)


def test_forks_share_both_tables_and_copy_on_write_in_each():
    kv = make(enable_prefix_caching=False)
    assert kv.allocate_slots("p", 6)  # 2 blocks per table, the last partly filled
    kv.fork("p", "c")
    last, window_last = kv.block_table("p")[-1], kv.window_table_view("p")[-1]
    assert kv.allocate_slots("c", 1)
    copies = kv.take_pending_copies()
    assert [src for src, _ in copies] == [last, window_last]
    assert kv.block_table("c")[-1] != last and kv.window_table_view("c")[-1] != window_last
    kv.free("p")
    kv.free("c")
    assert kv.num_free_blocks == kv.num_usable_blocks


def test_reserve_returns_both_tables_pages_and_refuses_what_does_not_fit():
    kv = make(num_blocks=9)  # 8 usable pages
    pages = kv.reserve("r", 10)
    # a query at 10 sees 5..10: the window page of block 0 is dropped at once, never to be sent
    assert kv.num_unseen_pages(10) == 1 and pages[0] == NULL_BLOCK_ID
    assert len(pages) == kv.num_blocks_for(10) == 6 and pages == kv.pages("r")
    assert kv.num_free_blocks == 3
    with pytest.raises(OutOfBlocksError, match="needs 4 KV blocks"):
        kv.reserve("s", 7)
    kv.release("r")
    assert kv.num_free_blocks == kv.num_usable_blocks


def test_a_window_group_needs_a_window():
    with pytest.raises(ValueError, match="sliding window"):
        KVCacheManager(num_blocks=8, block_size=BLOCK, window_group=True)
