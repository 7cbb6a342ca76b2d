"""`--metrics-port`: parsed once, served on its own port (or on the gateway's HTTP port)."""

from __future__ import annotations

import urllib.error
import urllib.request

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from prometheus_client import Counter

from cleave.config import MetricsConfig, gateway_config, kvstore_config, worker_config
from cleave.metrics import MetricLabels, ServiceMetrics, metrics_handler
from tests.metrics.scrape import parse, scrape, value


def test_metrics_port_flag_env_and_off_by_default(tmp_path):
    assert worker_config("decode", [], {}).service.metrics is None
    port_file = tmp_path / "m.port"
    parsed = worker_config("prefill", ["--metrics-port", "0", "--metrics-port-file", str(port_file)], {})
    assert parsed.service.metrics == MetricsConfig(port=0, host="", port_file=port_file)
    assert kvstore_config([], {"CLEAVE_METRICS_PORT": "9400"}).service.metrics == MetricsConfig(port=9400)
    assert gateway_config(["--metrics-port", "1", "--metrics-host", "0.0.0.0"], {}).service.metrics.host == "0.0.0.0"
    with pytest.raises(SystemExit, match="--metrics-port must be in"):
        worker_config("decode", ["--metrics-port", "70000"], {})
    with pytest.raises(SystemExit, match="needs --metrics-port"):
        worker_config("decode", ["--metrics-port-file", str(port_file)], {})


def test_a_process_serves_its_own_registry_on_the_grpc_host(tmp_path):
    port_file = tmp_path / "metrics.port"
    first = ServiceMetrics(MetricLabels("m", "a"), MetricsConfig(port=0, port_file=port_file))
    second = ServiceMetrics(MetricLabels("m", "b"))  # no config: nothing served, nothing shared
    Counter("cleave:things", "things", ["worker_id"], registry=first.registry).labels("a").inc(3)
    server = first.start("127.0.0.1")
    try:
        assert second.start("127.0.0.1") is None
        assert server is not None and server.host == "127.0.0.1"
        assert int(port_file.read_text()) == server.port > 0
        samples = scrape(server.url)
        assert value(samples, "cleave:things_total", worker_id="a") == 3
        assert second.registry.get_sample_value("cleave:things_total", {"worker_id": "a"}) is None
    finally:
        first.close()


async def test_the_aiohttp_route_serves_the_same_text():
    metrics = ServiceMetrics(MetricLabels("m", "gw"))
    metrics.grpc.observe("/cleave.v1.Gateway/Generate", "OK", 0.25)
    app = web.Application()
    app.router.add_get("/metrics", metrics_handler(metrics.registry))
    async with TestClient(TestServer(app)) as client:
        response = await client.get("/metrics")
        assert response.status == 200 and response.headers["Content-Type"].startswith("text/plain")
        samples = parse(await response.text())
    assert value(samples, "cleave:grpc_server_handled_total", grpc_method="Generate", grpc_code="OK",
                 model_name="m", worker_id="gw") == 1
    assert value(samples, "cleave:grpc_server_handling_seconds_sum", grpc_method="Generate") == 0.25


def test_names_keep_their_colon_when_the_scraper_asks_for_openmetrics():
    metrics = ServiceMetrics(MetricLabels("m", "a"), MetricsConfig(port=0))
    Counter("cleave:request_success", "done", ["worker_id"], registry=metrics.registry).labels("a").inc()
    server = metrics.start("127.0.0.1")
    try:
        accept = "application/openmetrics-text;version=1.0.0,text/plain;version=0.0.4;q=0.5"  # Prometheus 2.x's
        request = urllib.request.Request(server.url, headers={"Accept": accept})
        with urllib.request.urlopen(request, timeout=10) as response:
            assert response.headers["Content-Type"] == "text/plain; version=0.0.4; charset=utf-8"
            text = response.read().decode()
        assert 'cleave:request_success_total{worker_id="a"} 1.0' in text
        assert "cleave_request_success" not in text
        with pytest.raises(urllib.error.HTTPError) as raised:
            urllib.request.urlopen(server.url.replace("/metrics", "/other"), timeout=10)
        assert raised.value.code == 404
    finally:
        metrics.close()
