"""Prometheus metrics of every cleave service (`cleave:` names, after vLLM's where one exists).

One `ServiceMetrics` per process: its own registry (never the global one), the gRPC server
series (`cleave.rpc.metrics_interceptor`) and the exposition server on `--metrics-port`.
The role modules define the rest on that registry: `gateway` (requests: TTFT, TPOT, ITL,
finish reasons, routing), `engine` (queues, KV usage, prefix cache, steps), `transfer` (KV
transfers and handshakes of prefill workers), `kvstore` (tiers, hits, evictions).
Series that follow live state are read at scrape time, so hot loops pay nothing for them.
"""

from cleave.metrics.engine import BindEngineAfterStart, EngineMetrics
from cleave.metrics.exposition import MetricsServer, metrics_handler, start_metrics_server
from cleave.metrics.gateway import GatewayMetrics
from cleave.metrics.kvstore import KVStoreMetrics
from cleave.metrics.labels import MetricLabels
from cleave.metrics.service import ServiceMetrics
from cleave.metrics.transfer import PrefillTransferMetrics, TransferTotals, add_transfer

__all__ = [
    "BindEngineAfterStart",
    "EngineMetrics",
    "GatewayMetrics",
    "KVStoreMetrics",
    "MetricLabels",
    "MetricsServer",
    "PrefillTransferMetrics",
    "ServiceMetrics",
    "TransferTotals",
    "add_transfer",
    "metrics_handler",
    "start_metrics_server",
]
