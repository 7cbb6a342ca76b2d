"""Serving a registry: a tiny HTTP server on `--metrics-port`, and an aiohttp `/metrics` route.

Each process has its own `CollectorRegistry` and serves it on its own port. Gateway
replicas that share their gRPC and HTTP ports (SO_REUSEPORT) are separate processes, so each
gets its own metrics port too (`cleave up` hands every replica one) rather than
prometheus_client's multiprocess mode: a scrape of a shared port would reach one replica at
random, while one port per process gives Prometheus one target per replica, and sums over
replicas are a `sum by` away. The gateway's `/metrics` on its OpenAI HTTP port answers for
the replica the connection landed on.

Both always answer in the Prometheus text format 0.0.4, whatever the scraper's Accept
header asks: prometheus_client's OpenMetrics output (which Prometheus 2.x asks for first)
escapes the `:` of `cleave:` names to `_`, and dashboards and `cleave bench serve` read the
`cleave:` names.

The server runs on daemon threads of its own; collectors that read live state at scrape
time (engine queues, KV usage, store tiers) run there, reading counters only one thread
writes.
"""

from __future__ import annotations

import socket
import threading
from dataclasses import dataclass
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from aiohttp import web
from prometheus_client import CollectorRegistry, generate_latest

TEXT_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class _ThreadingServer(ThreadingMixIn, WSGIServer):
    daemon_threads = True  # a scrape in flight never holds the process open


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
        """Scrapes come every few seconds: no access log."""


def _wsgi_app(registry: CollectorRegistry):  # type: ignore[no-untyped-def]
    def app(environ: dict[str, Any], start_response):  # type: ignore[no-untyped-def]
        if environ.get("PATH_INFO", "/") not in ("/", "/metrics"):
            start_response("404 Not Found", [("Content-Type", "text/plain")])
            return [b"metrics are at /metrics\n"]
        body = generate_latest(registry)
        start_response("200 OK", [("Content-Type", TEXT_CONTENT_TYPE), ("Content-Length", str(len(body)))])
        return [body]

    return app


@dataclass
class MetricsServer:
    """A started exposition server: `http://host:port/metrics`."""

    host: str
    port: int
    _server: WSGIServer
    _thread: threading.Thread

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/metrics"

    def close(self) -> None:
        """Stop serving and release the port."""
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5.0)


def start_metrics_server(registry: CollectorRegistry, host: str, port: int) -> MetricsServer:
    """Serve `registry` on host:port (port 0: any free port) until `close()`."""
    server_class = _ThreadingServer
    if ":" in host:  # an IPv6 address
        server_class = type("_ThreadingServer6", (_ThreadingServer,), {"address_family": socket.AF_INET6})
    try:
        server = make_server(host, port, _wsgi_app(registry), server_class, handler_class=_QuietHandler)
    except OSError as exc:
        raise OSError(f"cannot serve metrics on {host}:{port}: {exc}; pick another --metrics-port") from exc
    thread = threading.Thread(target=server.serve_forever, name="cleave-metrics", daemon=True)
    thread.start()
    return MetricsServer(host, server.server_port, server, thread)


def metrics_handler(registry: CollectorRegistry):  # type: ignore[no-untyped-def]
    """An aiohttp handler answering GET with `registry` in the Prometheus text format."""

    async def handle(request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(registry), headers={"Content-Type": TEXT_CONTENT_TYPE})

    return handle
