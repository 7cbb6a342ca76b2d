"""Arrival offsets: seeded, mean gap 1/rate, gamma shape = burstiness."""

from __future__ import annotations

import math
import statistics

import pytest

from cleave.benchmark.arrivals import arrival_offsets

NUM = 20_000


def gaps(offsets: list[float]) -> list[float]:
    return [later - earlier for earlier, later in zip(offsets, offsets[1:])]


def test_same_seed_same_offsets_other_seed_other_offsets():
    assert arrival_offsets(50, 4.0, 1.0, seed=7) == arrival_offsets(50, 4.0, 1.0, seed=7)
    assert arrival_offsets(50, 4.0, 1.0, seed=7) != arrival_offsets(50, 4.0, 1.0, seed=8)


def test_offsets_start_at_zero_and_never_go_back():
    offsets = arrival_offsets(100, 10.0, 0.5, seed=1)
    assert offsets[0] == 0.0
    assert all(later >= earlier for earlier, later in zip(offsets, offsets[1:]))


@pytest.mark.parametrize("burstiness", [0.25, 1.0, 4.0])
def test_mean_rate_holds_and_spread_follows_burstiness(burstiness):
    rate = 8.0
    sample = gaps(arrival_offsets(NUM, rate, burstiness, seed=3))
    mean = statistics.fmean(sample)
    assert mean == pytest.approx(1 / rate, rel=0.05)
    # a gamma with shape k has coefficient of variation 1/sqrt(k): Poisson gaps 1, bursts > 1
    assert statistics.stdev(sample) / mean == pytest.approx(1 / math.sqrt(burstiness), rel=0.1)


def test_poisson_gaps_are_exponential():
    rate = 2.0
    sample = gaps(arrival_offsets(NUM, rate, 1.0, seed=5))
    within_mean = sum(gap <= 1 / rate for gap in sample) / len(sample)
    assert within_mean == pytest.approx(1 - math.exp(-1), abs=0.02)  # P(gap <= mean) of an exponential


def test_infinite_rate_sends_all_at_once_and_bad_values_are_refused():
    assert arrival_offsets(5, math.inf) == [0.0] * 5
    with pytest.raises(ValueError, match="rate"):
        arrival_offsets(5, 0.0)
    with pytest.raises(ValueError, match="burstiness"):
        arrival_offsets(5, 1.0, burstiness=0.0)
