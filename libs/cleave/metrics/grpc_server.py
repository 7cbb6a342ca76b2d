"""gRPC server metrics: calls handled by method and status code, and their latency.

Named after go-grpc-prometheus's (`grpc_server_handled_total`, `grpc_server_handling_seconds`)
under the `cleave:` prefix. `cleave.rpc.metrics_interceptor.MetricsInterceptor` feeds them;
a stream's latency is its whole life (an Attach stream's is hours).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram

from cleave.metrics.labels import PREFIX, RPC_SECONDS_BUCKETS, MetricLabels


class GrpcServerMetrics:
    """The two gRPC series of one server; `observe` is called once per finished call."""

    def __init__(self, registry: CollectorRegistry, labels: MetricLabels) -> None:
        names = (*MetricLabels.NAMES, "grpc_service", "grpc_method")
        self._labels = labels.values
        # (method, code) -> its two series: one dict lookup per call instead of two label lookups
        self._children: dict[tuple[str, str], tuple[Counter, Histogram]] = {}
        self.handled = Counter(f"{PREFIX}grpc_server_handled", "gRPC calls finished, by status code",
                               [*names, "grpc_code"], registry=registry)
        self.handling_seconds = Histogram(f"{PREFIX}grpc_server_handling_seconds",
                                          "Time from a call's start to its end (a stream's whole life)",
                                          names, buckets=RPC_SECONDS_BUCKETS, registry=registry)

    def observe(self, method: str, code: str, seconds: float) -> None:
        """One finished call of `method` ("/package.Service/Method") with its status code name."""
        children = self._children.get((method, code))
        if children is None:
            service, _, name = method.lstrip("/").partition("/")
            children = self._children[(method, code)] = (
                self.handled.labels(*self._labels, service, name, code),
                self.handling_seconds.labels(*self._labels, service, name),
            )
        handled, handling_seconds = children
        handled.inc()
        handling_seconds.observe(seconds)
