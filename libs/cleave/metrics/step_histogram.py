"""`StepHistogram`: a histogram one thread writes and the scrape reads, without a lock.

The engine's step loop runs a decode step in ~1 ms on the GPU, so what it records per step
must cost next to nothing: one `bisect` and two additions, no lock (prometheus_client's
`Histogram.observe` takes one per sample). Only the step thread calls `observe`; a scrape on
another thread copies the bucket list once and derives the count from that copy, so the
`+Inf` bucket always equals `_count` (the sum may trail by the sample being written).
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterator, Sequence

from prometheus_client import CollectorRegistry
from prometheus_client.core import HistogramMetricFamily


class StepHistogram:
    """Counts per bucket (upper bounds inclusive, as Prometheus's `le`) and a running sum.

    Args:
        bounds: the finite bucket upper bounds, increasing; +Inf is added.
    """

    def __init__(self, bounds: Sequence[float]) -> None:
        if list(bounds) != sorted(bounds) or len(set(bounds)) != len(bounds):
            raise ValueError(f"bucket bounds must increase strictly, got {list(bounds)}")
        self.bounds = tuple(float(bound) for bound in bounds)
        self._counts = [0] * (len(self.bounds) + 1)  # the last one is +Inf
        self._sum = 0.0

    def observe(self, value: float) -> None:
        """Record one sample (the writing thread only)."""
        self._counts[bisect_left(self.bounds, value)] += 1
        self._sum += value

    def buckets(self) -> tuple[list[tuple[str, int]], float]:
        """Cumulative (le, count) pairs ending with +Inf, and the sum."""
        counts = list(self._counts)
        total_sum = self._sum
        cumulative: list[tuple[str, int]] = []
        running = 0
        for bound, count in zip((*self.bounds, float("inf")), counts):
            running += count
            cumulative.append(("+Inf" if bound == float("inf") else repr(bound), running))
        return cumulative, total_sum

    def family(self, name: str, documentation: str, labels: dict[str, str]) -> HistogramMetricFamily:
        """This histogram as one labelled Prometheus family."""
        family = HistogramMetricFamily(name, documentation, labels=list(labels))
        buckets, total_sum = self.buckets()
        family.add_metric(list(labels.values()), buckets, total_sum)
        return family


class RegisteredHistogram(StepHistogram):
    """A `StepHistogram` that is one labelled series of `registry`, for samples taken once a
    token on one thread (the gateway's inter-token latency: prometheus_client's `observe`
    locks twice a sample).

    Args:
        registry: where the series is registered.
        name / documentation: the family's.
        labels: label names -> values of its one series.
        bounds: as for `StepHistogram`.
    """

    def __init__(self, registry: CollectorRegistry, name: str, documentation: str, labels: dict[str, str],
                 bounds: Sequence[float]) -> None:
        super().__init__(bounds)
        self._family_args = (name, documentation, dict(labels))
        registry.register(self)

    def collect(self) -> Iterator[HistogramMetricFamily]:
        yield self.family(*self._family_args)
