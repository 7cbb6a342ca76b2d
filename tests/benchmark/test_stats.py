"""Percentiles, TPOT, goodput and throughput of `cleave.benchmark.stats`."""

from __future__ import annotations

import numpy as np
import pytest

from cleave.benchmark.records import RequestRecord
from cleave.benchmark.stats import SLO, Distribution, percentile, summarize


def record(index: int, ttft_s: float | None, e2e_s: float | None, output_tokens: int, success: bool = True,
           prompt_len: int | None = 10, itl_s: list[float] | None = None, reason: str | None = None) -> RequestRecord:
    return RequestRecord(index=index, sent_s=0.0, prompt_len=prompt_len, output_len=output_tokens, success=success,
                         ttft_s=ttft_s, e2e_s=e2e_s, output_tokens=output_tokens, itl_s=itl_s or [],
                         error_reason=reason, error=None if success else "failed")


@pytest.mark.parametrize("values", [[5.0], [3.0, 1.0], [1.0, 2.0, 3.0, 4.0, 100.0], list(np.random.default_rng(0).random(37))])
@pytest.mark.parametrize("q", [0, 10, 50, 90, 99, 100])
def test_percentile_interpolates_like_numpy(values, q):
    assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)))


def test_percentile_by_hand_and_its_errors():
    assert percentile([10.0, 20.0, 30.0, 40.0], 50) == 25.0
    assert percentile([10.0, 20.0, 30.0, 40.0], 90) == pytest.approx(37.0)  # rank 2.7
    with pytest.raises(ValueError):
        percentile([], 50)
    with pytest.raises(ValueError):
        percentile([1.0], 101)


def test_tpot_is_time_after_the_first_token_over_the_tokens_after_it():
    assert record(0, ttft_s=0.1, e2e_s=1.1, output_tokens=11).tpot_s == pytest.approx(0.1)
    assert record(0, ttft_s=0.1, e2e_s=0.1, output_tokens=1).tpot_s is None  # one token: undefined
    assert record(0, ttft_s=0.1, e2e_s=0.5, output_tokens=5, success=False).tpot_s is None


def test_distribution_is_in_milliseconds():
    distribution = Distribution.of([0.001, 0.002, 0.003])
    assert distribution == Distribution(count=3, mean_ms=pytest.approx(2.0), median_ms=pytest.approx(2.0),
                                        p90_ms=pytest.approx(2.8), p99_ms=pytest.approx(2.98))
    assert Distribution.of([]) is None


def test_summary_counts_throughput_goodput_and_errors():
    records = [
        record(0, ttft_s=0.05, e2e_s=0.95, output_tokens=10, itl_s=[0.1] * 9),  # TPOT 100 ms: meets both
        record(1, ttft_s=0.30, e2e_s=1.20, output_tokens=10),  # TTFT 300 ms: misses the TTFT SLO
        record(2, ttft_s=0.05, e2e_s=2.75, output_tokens=10),  # TPOT 300 ms: misses the TPOT SLO
        record(3, ttft_s=0.05, e2e_s=0.05, output_tokens=1, prompt_len=None),  # no TPOT: meets
        record(4, None, None, 0, success=False, reason="HTTP 503"),
        record(5, None, None, 0, success=False, reason="HTTP 503"),
        record(6, None, None, 0, success=False, reason="timeout"),
    ]
    summary = summarize(records, duration_s=2.0, slo=SLO(ttft_ms=200, tpot_ms=150))
    assert (summary.num_requests, summary.completed, summary.failed) == (7, 4, 3)
    assert summary.request_throughput == pytest.approx(2.0)
    assert summary.total_output_tokens == 31
    assert summary.output_throughput == pytest.approx(15.5)
    assert (summary.total_input_tokens, summary.prompts_with_known_length) == (30, 3)
    assert summary.goodput_requests == 2
    assert summary.goodput_rps == pytest.approx(1.0)
    assert summary.goodput_fraction == pytest.approx(2 / 7)
    assert summary.errors == {"HTTP 503": 2, "timeout": 1}
    assert summary.tpot.count == 3  # the one-token request has none
    assert summary.tpot.median_ms == pytest.approx(100.0)
    assert summary.itl.count == 9
    assert summary.ttft.count == 4


def test_goodput_without_slo_is_not_reported_and_one_slo_alone_counts():
    records = [record(0, 0.05, 1.05, 11), record(1, 0.5, 0.6, 11)]
    assert summarize(records, 1.0).goodput_requests is None
    assert summarize(records, 1.0, SLO(ttft_ms=100)).goodput_requests == 1
    assert summarize(records, 1.0, SLO(tpot_ms=50)).goodput_requests == 1  # TPOTs 100 ms and 10 ms
