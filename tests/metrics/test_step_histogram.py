"""The step loop's lock-free histogram: Prometheus buckets, exact counts."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.registry import Collector

from cleave.metrics.step_histogram import RegisteredHistogram, StepHistogram


class _One(Collector):
    def __init__(self, histogram: StepHistogram) -> None:
        self.histogram = histogram

    def collect(self):
        yield self.histogram.family("cleave:x_seconds", "x", {"worker_id": "w"})


def test_samples_land_in_le_buckets_cumulatively():
    histogram = StepHistogram([0.001, 0.01, 0.1])
    for sample in (0.0005, 0.001, 0.002, 0.05, 3.0):
        histogram.observe(sample)
    registry = CollectorRegistry()
    registry.register(_One(histogram))
    get = lambda le: registry.get_sample_value("cleave:x_seconds_bucket", {"worker_id": "w", "le": le})  # noqa: E731
    assert [get("0.001"), get("0.01"), get("0.1"), get("+Inf")] == [2, 3, 4, 5]  # 0.001 is <= 0.001
    assert registry.get_sample_value("cleave:x_seconds_count", {"worker_id": "w"}) == 5
    assert registry.get_sample_value("cleave:x_seconds_sum", {"worker_id": "w"}) == pytest.approx(3.0535)


def test_bounds_must_increase():
    with pytest.raises(ValueError, match="increase"):
        StepHistogram([0.1, 0.01])


def test_a_registered_histogram_reads_as_prometheus_clients_own():
    bounds, samples = [0.0005, 0.01, 0.5], (0.0001, 0.0005, 0.003, 0.01, 0.2, 7.0, 0.0)
    ours_registry, theirs_registry = CollectorRegistry(), CollectorRegistry()
    ours = RegisteredHistogram(ours_registry, "cleave:itl_seconds", "gaps", {"model_name": "m", "worker_id": "g"},
                               bounds)
    theirs = Histogram("cleave:itl_seconds", "gaps", ["model_name", "worker_id"], buckets=bounds,
                       registry=theirs_registry).labels("m", "g")
    for sample in samples:
        ours.observe(sample)
        theirs.observe(sample)

    def series(registry: CollectorRegistry) -> dict:
        return {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
                for family in registry.collect() for sample in family.samples if not sample.name.endswith("_created")}

    assert series(ours_registry) == pytest.approx(series(theirs_registry))
    assert series(ours_registry)[("cleave:itl_seconds_count", (("model_name", "m"), ("worker_id", "g")))] == 7
