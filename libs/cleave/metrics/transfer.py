"""KV transfers and transport handshakes of a prefill worker, as series.

The worker adds each finished transfer's `TransferStats` to `TransferTotals` (one per
transport: plain integers, one request at a time on the event loop); the collector reads
them at scrape time. Bandwidth is `rate(cleave:kv_transfer_bytes_total[1m]) /
rate(cleave:kv_transfer_seconds_total[1m])`.

    cleave:kv_transfers_total{transport}
    cleave:kv_transfer_blocks_total{transport}
    cleave:kv_transfer_bytes_total{transport}
    cleave:kv_transfer_seconds_total{transport}    first byte sent to the receiver's verdict
    cleave:kv_transport_handshakes_total / cleave:kv_transport_handshake_failures_total
    cleave:kvstore_blocks_loaded_total / _stored_total, cleave:kvstore_puts_skipped_total
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Protocol

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, Metric

from cleave.metrics.labels import PREFIX, MetricLabels
from cleave.rpc.types import TransferStats


@dataclass
class TransferTotals:
    """What the transfers over one transport moved, since the worker started."""

    num_transfers: int = 0
    num_blocks: int = 0
    num_bytes: int = 0
    seconds: float = 0.0

    def add(self, stats: TransferStats) -> None:
        self.num_transfers += 1
        self.num_blocks += stats.num_blocks
        self.num_bytes += stats.num_bytes
        self.seconds += stats.seconds


def add_transfer(totals: dict[str, TransferTotals], stats: TransferStats) -> None:
    """Count one finished transfer under its transport's name."""
    totals.setdefault(stats.transport.value, TransferTotals()).add(stats)


class PrefillCountersView(Protocol):
    """The prefill worker's cumulative counters this collector reads."""

    num_kvstore_blocks_loaded: int
    num_kvstore_blocks_stored: int
    num_kvstore_puts_skipped: int
    transfers: Mapping[str, TransferTotals]


class HandshakeCounts(Protocol):
    """A transport negotiator's counters."""

    num_handshakes: int
    num_handshake_failures: int


class PrefillTransferMetrics:
    """Collector of a prefill worker's transfer, handshake and kvstore counters.

    Args:
        registry: the process's registry; this collector registers itself there.
        labels: model_name and worker_id.
        counters: the worker's counters (read at every scrape).
        negotiator: the worker's transport negotiator, None before it started.
    """

    def __init__(self, registry: CollectorRegistry, labels: MetricLabels,
                 counters: Callable[[], PrefillCountersView],
                 negotiator: Callable[[], HandshakeCounts | None]) -> None:
        self._names = list(MetricLabels.NAMES)
        self._values = list(labels.values)
        self._counters = counters
        self._negotiator = negotiator
        registry.register(self)

    def collect(self) -> Iterator[Metric]:
        names, values = self._names, self._values
        counters, negotiator = self._counters(), self._negotiator()
        per_transport = sorted(dict(counters.transfers).items())
        for name, doc, field in (
            ("kv_transfers", "KV transfers confirmed by the receiver", "num_transfers"),
            ("kv_transfer_blocks", "KV blocks moved", "num_blocks"),
            ("kv_transfer_bytes", "KV bytes moved", "num_bytes"),
            ("kv_transfer_seconds", "Time from a transfer's start to the receiver's verdict", "seconds"),
        ):
            family = CounterMetricFamily(f"{PREFIX}{name}", f"{doc}, by transport", labels=[*names, "transport"])
            for transport, totals in per_transport:
                family.add_metric([*values, transport], getattr(totals, field))
            yield family
        for name, doc, value in (
            ("kv_transport_handshakes", "Transport handshakes with decode workers",
             negotiator.num_handshakes if negotiator else 0),
            ("kv_transport_handshake_failures", "Transport handshakes that failed (the handle's transport is used)",
             negotiator.num_handshake_failures if negotiator else 0),
            ("kvstore_blocks_loaded", "Prompt blocks loaded from the kvstore", counters.num_kvstore_blocks_loaded),
            ("kvstore_blocks_stored", "Prompt blocks stored into the kvstore", counters.num_kvstore_blocks_stored),
            ("kvstore_puts_skipped", "Prompts not stored: the put backlog was full", counters.num_kvstore_puts_skipped),
        ):
            family = CounterMetricFamily(f"{PREFIX}{name}", doc, labels=names)
            family.add_metric(values, value)
            yield family
