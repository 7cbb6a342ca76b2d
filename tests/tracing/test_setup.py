"""setup_tracing with an OTLP endpoint: spans are POSTed to <endpoint>/v1/traces (OTLP/HTTP
protobuf), here to a local HTTP server."""

from __future__ import annotations

import http.server
import threading

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from cleave.tracing import TracingConfig, setup_tracing, span
from cleave.tracing.setup import otlp_traces_url

CALLER = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


class Collector(http.server.ThreadingHTTPServer):
    """Keeps each POST's path, content type and body."""

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.received: list[tuple[str, str, bytes]] = []
        self.got_post = threading.Event()


class _Handler(http.server.BaseHTTPRequestHandler):
    def do_POST(self) -> None:  # noqa: N802 - http.server's naming
        body = self.rfile.read(int(self.headers["Content-Length"]))
        self.server.received.append((self.path, self.headers["Content-Type"], body))  # type: ignore[attr-defined]
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", "0")
        self.end_headers()
        self.server.got_post.set()  # type: ignore[attr-defined]

    def log_message(self, *args: object) -> None:
        pass


def test_otlp_url_of_a_collector_base_url():
    assert otlp_traces_url("http://collector:4318") == "http://collector:4318/v1/traces"
    assert otlp_traces_url("http://collector:4318/") == "http://collector:4318/v1/traces"


def test_spans_reach_an_otlp_http_collector():
    collector = Collector()
    thread = threading.Thread(target=collector.serve_forever, daemon=True)
    thread.start()
    try:
        endpoint = f"http://127.0.0.1:{collector.server_address[1]}"
        tracing = setup_tracing(TracingConfig(service_name="cleave-prefill", otlp_endpoint=endpoint))
        server_span = tracing.start_server_span("cleave.v1.Prefill/Prefill", CALLER, request_id="r9")
        with span("engine.prefill_forward", request_id="r9"):
            pass
        server_span.end()
        tracing.shutdown()  # exports what is batched before returning
        assert collector.got_post.wait(10)
    finally:
        collector.shutdown()
        collector.server_close()
    path, content_type, body = collector.received[0]
    assert (path, content_type) == ("/v1/traces", "application/x-protobuf")
    request = ExportTraceServiceRequest.FromString(body)
    (resource_spans,) = request.resource_spans
    resource = {a.key: a.value.string_value for a in resource_spans.resource.attributes}
    assert resource["service.name"] == "cleave-prefill"
    spans = {s.name: s for scope in resource_spans.scope_spans for s in scope.spans}
    assert set(spans) == {"cleave.v1.Prefill/Prefill", "engine.prefill_forward"}
    server = spans["cleave.v1.Prefill/Prefill"]
    assert server.trace_id.hex() == "4bf92f3577b34da6a3ce929d0e0e4736"
    assert server.parent_span_id.hex() == "00f067aa0ba902b7"
    assert spans["engine.prefill_forward"].parent_span_id == server.span_id
    assert {a.key: a.value.string_value for a in server.attributes} == {"request_id": "r9"}
