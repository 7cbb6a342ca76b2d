"""The kvstore's series, read from `StoreStats` at scrape time.

    cleave:kvstore_blocks{tier}, cleave:kvstore_bytes{tier}     what each tier holds (ram, disk)
    cleave:kvstore_hits_total / _misses_total                   blocks asked for, found / not
    cleave:kvstore_bytes_served_total
    cleave:kvstore_evictions_total                              blocks dropped for space
    cleave:kvstore_checksum_failures_total                      corrupt disk files dropped

Put and Get latency are the gRPC server series of `/cleave.v1.KVStore/Put` and `/Get`
(`cleave:grpc_server_handling_seconds`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Protocol

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from cleave.metrics.labels import PREFIX, MetricLabels


class StoreStatsView(Protocol):
    """The store counters this collector reads (`services.kvstore.backend.StoreStats`)."""

    hits: int
    misses: int
    bytes_served: int
    evictions: int
    num_blocks_ram: int
    num_blocks_disk: int
    num_bytes_ram: int
    num_bytes_disk: int
    checksum_failures: int
    num_lookups: int


class KVStoreMetrics:
    """Collector over a block store's `stats()`.

    Args:
        registry: the process's registry; this collector registers itself there.
        labels: model_name (empty: the store serves whichever layout connects) and worker_id.
        stats: the store's counters now.
    """

    def __init__(self, registry: CollectorRegistry, labels: MetricLabels, stats: Callable[[], StoreStatsView]) -> None:
        self._names = list(MetricLabels.NAMES)
        self._values = list(labels.values)
        self._stats = stats
        registry.register(self)

    def collect(self) -> Iterator[Metric]:
        names, values, stats = self._names, self._values, self._stats()
        blocks = GaugeMetricFamily(f"{PREFIX}kvstore_blocks", "Blocks held, by tier", labels=[*names, "tier"])
        num_bytes = GaugeMetricFamily(f"{PREFIX}kvstore_bytes", "Payload bytes held, by tier", labels=[*names, "tier"])
        for tier, count, size in (("ram", stats.num_blocks_ram, stats.num_bytes_ram),
                                  ("disk", stats.num_blocks_disk, stats.num_bytes_disk)):
            blocks.add_metric([*values, tier], count)
            num_bytes.add_metric([*values, tier], size)
        yield blocks
        yield num_bytes
        for name, doc, value in (
            ("kvstore_hits", "Blocks asked for (Lookup, Get) and found", stats.hits),
            ("kvstore_misses", "Blocks asked for and not found", stats.misses),
            ("kvstore_bytes_served", "Payload bytes sent by Get", stats.bytes_served),
            ("kvstore_evictions", "Blocks dropped for space", stats.evictions),
            ("kvstore_checksum_failures", "Disk block files dropped as corrupt", stats.checksum_failures),
            ("kvstore_lookups", "Lookup calls answered (prefill workers with a live index of the store make none)",
             stats.num_lookups),
        ):
            family = CounterMetricFamily(f"{PREFIX}{name}", doc, labels=names)
            family.add_metric(values, value)
            yield family
