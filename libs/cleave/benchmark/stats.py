"""Records -> `Summary`: latency distributions, throughput, goodput and error counts.

Definitions (vLLM's and SGLang's, so numbers compare across the three benchmarks):
- TTFT: send -> first streamed chunk with a choice (a token).
- TPOT: (e2e - TTFT) / (output_tokens - 1), per request; undefined for one token or none.
- ITL: gaps between consecutive such chunks, pooled over all requests.
- e2e: send -> end of the stream.
- throughput: completed requests, and their prompt / output tokens, per second of the run.
- goodput: completed requests that met every SLO given (TTFT and TPOT), per second.
Percentiles interpolate linearly between order statistics (numpy's default).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from cleave.benchmark.records import RequestRecord


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0-100) with linear interpolation.

    Raises:
        ValueError: no values, or q outside [0, 100].
    """
    if not values:
        raise ValueError("percentile of no values")
    if not 0 <= q <= 100:
        raise ValueError(f"percentile must be in [0, 100], got {q}")
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


@dataclass(frozen=True)
class Distribution:
    """Mean, median, p90 and p99 of one latency, in milliseconds, over `count` values."""

    count: int
    mean_ms: float
    median_ms: float
    p90_ms: float
    p99_ms: float

    @classmethod
    def of(cls, values_s: Sequence[float]) -> "Distribution | None":
        if not values_s:
            return None
        ms = [value * 1000 for value in values_s]
        return cls(len(ms), sum(ms) / len(ms), percentile(ms, 50), percentile(ms, 90), percentile(ms, 99))


@dataclass(frozen=True)
class SLO:
    """Per-request service levels; None: not part of goodput."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None

    @property
    def is_set(self) -> bool:
        return self.ttft_ms is not None or self.tpot_ms is not None

    def met_by(self, record: RequestRecord) -> bool:
        """A completed request within every SLO given (a request of one token has no TPOT and
        meets any TPOT SLO; one without tokens has no TTFT and misses a TTFT SLO)."""
        if not record.success:
            return False
        if self.ttft_ms is not None and (record.ttft_s is None or record.ttft_s * 1000 > self.ttft_ms):
            return False
        tpot = record.tpot_s
        return self.tpot_ms is None or tpot is None or tpot * 1000 <= self.tpot_ms


@dataclass(frozen=True)
class Summary:
    """What one run measured (latencies None when no request produced the value).

    Input tokens count the prompts whose length is known (the server's usage, else the
    benchmark's tokenizer): `prompts_with_known_length` of `completed`.
    """

    num_requests: int
    completed: int
    failed: int
    duration_s: float
    request_throughput: float
    total_input_tokens: int
    total_output_tokens: int
    prompts_with_known_length: int
    input_throughput: float
    output_throughput: float
    ttft: Distribution | None
    tpot: Distribution | None
    itl: Distribution | None
    e2e: Distribution | None
    errors: dict[str, int]
    slo: SLO
    goodput_requests: int | None
    goodput_rps: float | None

    @property
    def goodput_fraction(self) -> float | None:
        if self.goodput_requests is None or not self.num_requests:
            return None
        return self.goodput_requests / self.num_requests

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "goodput_fraction": self.goodput_fraction}


def summarize(records: Sequence[RequestRecord], duration_s: float, slo: SLO = SLO()) -> Summary:
    """The `Summary` of a run's records over its wall time."""
    if duration_s <= 0:
        raise ValueError(f"a run's duration must be positive, got {duration_s}")
    done = [r for r in records if r.success]
    known = [r.prompt_len for r in done if r.prompt_len is not None]
    input_tokens = sum(known)
    output_tokens = sum(r.output_tokens for r in done)
    errors = Counter(r.error_reason or "unknown" for r in records if not r.success)
    good = sum(slo.met_by(r) for r in records) if slo.is_set else None
    return Summary(
        num_requests=len(records),
        completed=len(done),
        failed=len(records) - len(done),
        duration_s=duration_s,
        request_throughput=len(done) / duration_s,
        total_input_tokens=input_tokens,
        total_output_tokens=output_tokens,
        prompts_with_known_length=len(known),
        input_throughput=input_tokens / duration_s,
        output_throughput=output_tokens / duration_s,
        ttft=Distribution.of([r.ttft_s for r in done if r.ttft_s is not None]),
        tpot=Distribution.of([r.tpot_s for r in done if r.tpot_s is not None]),
        itl=Distribution.of([gap for r in done for gap in r.itl_s]),
        e2e=Distribution.of([r.e2e_s for r in done if r.e2e_s is not None]),
        errors=dict(errors.most_common()),
        slo=slo,
        goodput_requests=good,
        goodput_rps=None if good is None else good / duration_s,
    )
