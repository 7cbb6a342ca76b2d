"""`ServiceMetrics`: one service process's registry, gRPC server series and exposition server.

A registry is built per service instance and handed down to whatever defines series (the
gateway's request metrics, an engine collector, the store's): nothing registers in
prometheus_client's global registry, so two services in one test process never share a
series. `run_service(..., metrics=...)` adds the gRPC interceptor and serves the registry
on `--metrics-port` (see `cleave.metrics.exposition` for why every process, gateway
replicas included, gets a port of its own).
"""

from __future__ import annotations

import structlog
from prometheus_client import CollectorRegistry

from cleave.config import MetricsConfig
from cleave.metrics.exposition import MetricsServer, start_metrics_server
from cleave.metrics.grpc_server import GrpcServerMetrics
from cleave.metrics.labels import MetricLabels
from cleave.rpc.metrics_interceptor import MetricsInterceptor
from cleave.rpc.server import write_port_file

log = structlog.get_logger("cleave.metrics")


class ServiceMetrics:
    """A process's metrics.

    Args:
        labels: model_name and worker_id of every series.
        config: where to serve them (`--metrics-port`); None: only in-process (the gateway
            still answers `/metrics` on its HTTP port).
    """

    def __init__(self, labels: MetricLabels, config: MetricsConfig | None = None) -> None:
        self.labels = labels
        self.config = config
        self.registry = CollectorRegistry(auto_describe=True)
        self.grpc = GrpcServerMetrics(self.registry, labels)
        self.interceptor = MetricsInterceptor(self.grpc)
        self.server: MetricsServer | None = None

    def start(self, default_host: str) -> MetricsServer | None:
        """Serve the registry when configured (on `default_host`, the gRPC host, unless the
        config names one); writes the port file and logs the URL."""
        if self.config is None:
            return None
        host = self.config.host or default_host
        self.server = start_metrics_server(self.registry, host, self.config.port)
        if self.config.port_file is not None:
            write_port_file(self.config.port_file, self.server.port)
        log.info("metrics listening", url=self.server.url, worker_id=self.labels.worker_id)
        return self.server

    def close(self) -> None:
        """Stop the exposition server (series stay readable in-process)."""
        if self.server is not None:
            self.server.close()
            self.server = None
