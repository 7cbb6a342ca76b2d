"""`setup_tracing`: a process's TracerProvider and exporters, from its `TracingConfig`.

    tracing = setup_tracing(config.service.tracing)   # in a service's __main__
    await run_service(..., tracing=tracing)            # server spans for every call
    tracing.shutdown()                                 # flush at exit

With an OTLP endpoint, spans go to `<endpoint>/v1/traces` as OTLP/HTTP protobuf
(opentelemetry-exporter-otlp-proto-http); with a trace file, to JSON lines
(`JsonLinesSpanExporter`). Both batch on the SDK's exporter thread. With neither, nothing is
installed and `Tracing.start_server_span` hands out `NOOP_SERVER_SPAN`.
"""

from __future__ import annotations

from typing import Any

from opentelemetry import trace
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor

from cleave.config import TracingConfig
from cleave.tracing.file_exporter import JsonLinesSpanExporter
from cleave.tracing.propagation import check_traceparent
from cleave.tracing.server_span import NOOP_SERVER_SPAN, ServerSpan, start_server_span

TRACER_NAME = "cleave"
# Spans wait here for the exporter thread; a burst larger than this drops spans (the SDK
# logs it) rather than blocking a request.
MAX_QUEUED_SPANS = 16384


class Tracing:
    """What `setup_tracing` installed: the provider (None when tracing is off) and its tracer.

    Args:
        config: the process's tracing settings.
        provider: an SDK TracerProvider with its exporters, or None for tracing off.
    """

    def __init__(self, config: TracingConfig, provider: TracerProvider | None) -> None:
        self.config = config
        self._provider = provider
        self.tracer: trace.Tracer | None = None if provider is None else provider.get_tracer(TRACER_NAME)

    @property
    def enabled(self) -> bool:
        return self.tracer is not None

    def start_server_span(
        self, name: str, traceparent: str | None, tracestate: str | None = None, **attributes: Any
    ) -> ServerSpan:
        """Check the caller's traceparent (InvalidArgument naming it when malformed, tracing
        on or off), then start `name` as the current SERVER span (`NOOP_SERVER_SPAN` when
        tracing is off). End it with `ServerSpan.end()` in the same task."""
        if traceparent is not None:
            check_traceparent(traceparent)
        if self.tracer is None:
            return NOOP_SERVER_SPAN
        return start_server_span(self.tracer, name, traceparent, tracestate, **attributes)

    def shutdown(self) -> None:
        """Export every finished span and stop the exporters (safe to call twice)."""
        provider, self._provider = self._provider, None
        if provider is not None:
            provider.force_flush()
            provider.shutdown()


TRACING_OFF = Tracing(TracingConfig(service_name="cleave"), None)


def otlp_traces_url(endpoint: str) -> str:
    """The OTLP/HTTP traces URL of a collector base URL (`OTEL_EXPORTER_OTLP_ENDPOINT`)."""
    return endpoint.rstrip("/") + "/v1/traces"


def setup_tracing(config: TracingConfig) -> Tracing:
    """A TracerProvider (resource service.name) with an OTLP/HTTP exporter when
    `config.otlp_endpoint` is set and a JSON-lines exporter when `config.trace_file` is set;
    with neither, tracing is off and nothing is installed."""
    if not config.enabled:
        return Tracing(config, None)
    provider = TracerProvider(resource=Resource.create({SERVICE_NAME: config.service_name}))
    if config.otlp_endpoint is not None:
        # Imported only when asked for: the exporter pulls in requests and the OTLP protos.
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        exporter = OTLPSpanExporter(endpoint=otlp_traces_url(config.otlp_endpoint))
        provider.add_span_processor(BatchSpanProcessor(exporter, max_queue_size=MAX_QUEUED_SPANS))
    if config.trace_file is not None:
        exporter = JsonLinesSpanExporter(config.trace_file, config.service_name)
        provider.add_span_processor(BatchSpanProcessor(exporter, max_queue_size=MAX_QUEUED_SPANS))
    return Tracing(config, provider)
