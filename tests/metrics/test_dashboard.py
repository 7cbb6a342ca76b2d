"""The Grafana dashboard reads only series the services define (a renamed metric would leave
a panel silently empty)."""

from __future__ import annotations

import json
import re
from pathlib import Path

from prometheus_client import CollectorRegistry

from cleave.metrics import (
    EngineMetrics, GatewayMetrics, KVStoreMetrics, MetricLabels, PrefillTransferMetrics, ServiceMetrics,
)
from cleave.metrics.transfer import TransferTotals
from services.kvstore.store import BlockStore, StoreConfig

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "dashboards" / "cleave.json"
SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}


class _Counters:
    num_kvstore_blocks_loaded = num_kvstore_blocks_stored = num_kvstore_puts_skipped = 0
    transfers = {"tcp": TransferTotals()}


def defined_series() -> set[str]:
    """Every sample name the four services expose."""
    labels = MetricLabels("m", "w")
    service = ServiceMetrics(labels)
    registry: CollectorRegistry = service.registry
    GatewayMetrics(registry, labels).track_decode_workers(lambda: ())
    EngineMetrics(registry, labels)
    PrefillTransferMetrics(registry, labels, lambda: _Counters(), lambda: None)
    KVStoreMetrics(registry, labels, BlockStore(StoreConfig(ram_bytes=1)).stats)  # type: ignore[arg-type]
    names = set()
    for family in registry.collect():
        for suffix in SUFFIXES.get(family.type, ("",)):
            names.add(family.name + suffix)
    return names


def dashboard_exprs() -> list[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [target["expr"] for panel in dashboard["panels"] for target in panel.get("targets", ())]
    exprs += [variable["definition"] for variable in dashboard["templating"]["list"] if "definition" in variable]
    return exprs


def test_every_series_on_the_dashboard_is_defined():
    defined = defined_series()
    used = {name for expr in dashboard_exprs() for name in re.findall(r"cleave:[A-Za-z0-9_:]+", expr)}
    assert used - defined == set()
    for needed in ("cleave:time_to_first_token_seconds_bucket", "cleave:time_per_output_token_seconds_bucket",
                   "cleave:inter_token_latency_seconds_bucket", "cleave:kv_cache_usage_perc",
                   "cleave:prefix_cache_hits_total", "cleave:kv_transfer_bytes_total",
                   "cleave:request_failure_total"):
        assert needed in used, needed


def test_the_names_other_tools_read_stay_exactly_these():
    # `cleave bench serve` reads these two from the gateway's /metrics
    assert {"cleave:request_success_total", "cleave:time_to_first_token_seconds_bucket",
            "cleave:time_to_first_token_seconds_count"} <= defined_series()
