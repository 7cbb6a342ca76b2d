"""Tracing settings in every service's config: `--trace-file` / CLEAVE_TRACE_FILE and
`--otlp-endpoint` / OTEL_EXPORTER_OTLP_ENDPOINT, read once in cleave.config."""

from __future__ import annotations

from cleave.config import gateway_config, kvstore_config, worker_config


def test_trace_settings_come_from_flags_or_the_environment(tmp_path):
    config = kvstore_config(["--trace-file", str(tmp_path / "k.jsonl")], {})
    assert config.service.tracing.service_name == "cleave-kvstore"
    assert config.service.tracing.trace_file == tmp_path / "k.jsonl" and config.service.tracing.otlp_endpoint is None
    environ = {"CLEAVE_TRACE_FILE": str(tmp_path / "e.jsonl"), "OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"}
    tracing = kvstore_config([], environ).service.tracing
    assert (tracing.trace_file, tracing.otlp_endpoint) == (tmp_path / "e.jsonl", "http://collector:4318")
    assert not kvstore_config([], {}).service.tracing.enabled


def test_each_service_names_itself_and_the_flag_wins_over_the_environment():
    environ = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://env:4318"}
    assert gateway_config([], environ).service.tracing.service_name == "cleave-gateway"
    decode = worker_config("decode", ["--otlp-endpoint", "http://flag:4318"], environ).service.tracing
    assert (decode.service_name, decode.otlp_endpoint) == ("cleave-decode", "http://flag:4318")
    assert worker_config("prefill", [], {}).service.tracing.service_name == "cleave-prefill"
