"""Routing choices and prefix affinity, on hand-made worker loads (no servers)."""

from __future__ import annotations

from cleave.proto.cleave.v1 import common_pb2
from services.gateway.routing import AFFINITY_SLACK_TOKENS, PrefixAffinity, pick_decode, pick_prefill
from services.gateway.workers import WorkerHandle


def worker(address: str, role: str = "decode", **load) -> WorkerHandle:
    return WorkerHandle(role, address, None, None, None, healthy=True, load=common_pb2.WorkerLoad(**load))  # type: ignore[arg-type]


def test_decode_prefers_idle_then_free_blocks_and_skips_full_workers():
    busy = worker("a", num_running=3, num_free_blocks=90, num_total_blocks=100)
    idle_small = worker("b", num_running=0, num_free_blocks=20, num_total_blocks=100)
    idle_big = worker("c", num_running=0, num_free_blocks=50, num_total_blocks=100)
    assert pick_decode([busy, idle_small, idle_big], num_blocks_needed=4).address == "c"
    assert pick_decode([busy, idle_small, idle_big], num_blocks_needed=60).address == "a"  # only one fits
    idle_big.in_flight = 5  # requests this gateway just routed there count before the next poll
    assert pick_decode([busy, idle_small, idle_big], num_blocks_needed=4).address == "b"
    assert pick_decode([], 1) is None


def test_prefix_affinity_follows_the_longest_known_prefix():
    affinity = PrefixAffinity(block_size=4)
    shared = list(range(8))
    affinity.record(shared + [100, 101, 102, 103], "p1")
    affinity.record(shared + [200, 201, 202, 203], "p2")
    assert affinity.lookup(shared + [100, 101, 102, 103, 7]) == ("p1", 3)
    assert affinity.lookup(shared + [9, 9, 9, 9]) == ("p2", 2)  # the shared blocks were last served by p2
    assert affinity.lookup([5, 5, 5, 5]) == (None, 0)
    assert affinity.lookup([0, 1, 2]) == (None, 0)  # no full block


def test_prefix_affinity_counts_a_prefix_only_under_its_salt():
    affinity = PrefixAffinity(block_size=4)
    prompt = list(range(8))
    affinity.record(prompt, "p1", affinity.hashes(prompt, "tenant-a"))
    assert affinity.lookup(prompt, affinity.hashes(prompt, "tenant-a")) == ("p1", 2)
    assert affinity.lookup(prompt, affinity.hashes(prompt, "tenant-b")) == (None, 0)
    assert affinity.lookup(prompt) == (None, 0)


def test_prefill_uses_affinity_unless_much_busier():
    affinity = PrefixAffinity(block_size=4)
    prompt = list(range(16))
    first, second = worker("p1", "prefill"), worker("p2", "prefill")
    affinity.record(prompt, "p2")
    assert pick_prefill([first, second], affinity, prompt).address == "p2"
    second.load.num_queued_prompt_tokens = AFFINITY_SLACK_TOKENS + 1
    assert pick_prefill([first, second], affinity, prompt).address == "p1"
    assert pick_prefill([first, second], affinity, [7] * 16).address == "p1"
    assert pick_prefill([], affinity, prompt) is None


def test_affinity_table_is_bounded():
    affinity = PrefixAffinity(block_size=1, capacity=3)
    affinity.record([1, 2, 3, 4, 5], "p")
    assert affinity.lookup([1]) == (None, 0)  # the oldest hashes were evicted
    assert len(affinity._owner) == 3
