"""`cleave up`'s split of a GPU's memory between the workers placed on it."""

from __future__ import annotations

import pytest

from cleave.cli._memory_split import MemorySplit, PlacedWorker, device_key, memory_shares


def _workers(num_prefill: int, num_decode: int, device: str = "cuda") -> list[PlacedWorker]:
    return ([PlacedWorker(f"prefill-{i}", "prefill", device) for i in range(num_prefill)]
            + [PlacedWorker(f"decode-{i}", "decode", device) for i in range(num_decode)])


def test_one_prefill_one_decode_decode_gets_two_thirds():
    assert memory_shares(_workers(1, 1)) == {"prefill-0": 0.3, "decode-0": 0.6}


def test_two_prefill_two_decode_on_one_device():
    shares = memory_shares(_workers(2, 2))
    assert shares == {"prefill-0": 0.15, "prefill-1": 0.15, "decode-0": 0.3, "decode-1": 0.3}
    assert sum(shares.values()) == pytest.approx(0.9)


def test_a_colocated_decode_worker_gets_the_whole_utilization():
    assert memory_shares(_workers(0, 1)) == {"decode-0": 0.9}


def test_equal_split_and_other_utilization():
    shares = memory_shares(_workers(1, 2), utilization=0.75, split=MemorySplit.parse("1:1"))
    assert shares == {"prefill-0": 0.25, "decode-0": 0.25, "decode-1": 0.25}


def test_workers_on_different_devices_do_not_share():
    workers = [PlacedWorker("prefill-0", "prefill", "cuda:0"), PlacedWorker("decode-0", "decode", "cuda:1"),
               PlacedWorker("decode-1", "decode", "cuda")]  # "cuda" is cuda:0
    assert memory_shares(workers) == {"prefill-0": 0.3, "decode-0": 0.9, "decode-1": 0.6}


def test_cpu_workers_get_no_share():
    assert memory_shares(_workers(1, 1, device="cpu")) == {}
    assert device_key("cpu") is None and device_key("cuda") == "cuda:0" and device_key("cuda:3") == "cuda:3"


@pytest.mark.parametrize("text", ["2", "1:0", "a:b", "-1:2", ""])
def test_bad_splits_are_refused(text):
    with pytest.raises(ValueError, match="PREFILL:DECODE"):
        MemorySplit.parse(text)


def test_split_round_trips_and_bad_utilization_is_refused():
    assert str(MemorySplit.parse("1:2.5")) == "1:2.5" and MemorySplit.parse("1:2") == MemorySplit()
    with pytest.raises(ValueError, match=r"\(0, 1\]"):
        memory_shares(_workers(1, 1), utilization=1.5)
