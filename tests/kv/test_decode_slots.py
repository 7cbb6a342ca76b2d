"""KVCacheManager.allocate_decode_slots: the same tables, copies and free counts as one
allocate_slots(seq_id, 1) per sequence, over forks (copy-on-write) and block boundaries."""

from cleave.kv.manager import KVCacheManager

BLOCK = 4


def _managers() -> tuple[KVCacheManager, KVCacheManager]:
    """Two identical managers: a at a block boundary, b mid-block, c and d forked from b."""
    pair = []
    for _ in range(2):
        kv = KVCacheManager(num_blocks=24, block_size=BLOCK)
        assert kv.allocate_slots("a", 8) and kv.allocate_slots("b", 6)
        kv.fork("b", "c")
        kv.fork("b", "d")
        pair.append(kv)
    return pair[0], pair[1]


def _state(kv: KVCacheManager, seq_ids: list[str]) -> tuple:
    return [kv.block_table(s) for s in seq_ids], [kv.num_tokens(s) for s in seq_ids], kv.num_free_blocks


def test_decode_slots_match_one_allocate_slots_per_sequence():
    batched, single = _managers()
    order = ["c", "a", "b", "d", "e"]  # e holds nothing yet
    for _ in range(6):  # across the next block boundary of every sequence
        assert batched.allocate_decode_slots(order)
        for seq_id in order:
            assert single.allocate_slots(seq_id, 1)
        assert batched.take_pending_copies() == single.take_pending_copies()
        assert _state(batched, order) == _state(single, order)
    # c and b wrote into the shared block 4 first (copied to 5 and 7); d was its last holder.
    tables = [[3, 5, 9], [1, 2, 6, 12], [3, 7, 10], [3, 4, 11], [8, 13]]
    assert _state(batched, order) == (tables, [12, 14, 12, 12, 6], 10)


def test_decode_slots_need_a_free_block_per_sequence():
    kv = KVCacheManager(num_blocks=4, block_size=BLOCK)
    assert kv.allocate_slots("a", 4) and kv.allocate_slots("b", 3)
    assert kv.num_free_blocks == 1
    assert not kv.allocate_decode_slots(["a", "b"])  # nothing changed
    assert (kv.block_table("a"), kv.num_tokens("a"), kv.num_tokens("b")) == ([1], 4, 3)
    assert kv.allocate_decode_slots(["a"]) and kv.block_table("a") == [1, 3]
