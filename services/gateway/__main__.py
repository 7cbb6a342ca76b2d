"""`python -m services.gateway`: config, then serve gRPC (and the OpenAI HTTP API) in one loop."""

from __future__ import annotations

import asyncio
import os
import sys
from dataclasses import replace
from pathlib import Path

import structlog
from aiohttp import web

from cleave.config import GatewayConfig, gateway_config
from cleave.logging import configure_logging
from cleave.metrics import GatewayMetrics, MetricLabels, ServiceMetrics
from cleave.model.source import ModelNotFound
from cleave.proto.cleave.v1 import gateway_pb2, gateway_pb2_grpc
from cleave.rpc import ServiceRegistration, run_service, write_port_file
from cleave.rpc.auth import api_key_auth
from cleave.tls import TlsConfig
from cleave.tracing import TRACING_OFF, Tracing, setup_tracing
from services.gateway.client_errors import ClientSafeBackend
from services.gateway.disagg_policy import DisaggregationPolicy
from services.gateway.http_api import OpenAIApi, bound_port, start_http
from services.gateway.metered import MeteredBackend
from services.gateway.model import ServedModel
from services.gateway.router import GatewayOptions, RoutingBackend
from services.gateway.servicer import GatewayServicer
from services.gateway.tenant_limits import TenantLimits
from services.gateway.workers import PoolOptions

SERVICE_NAME = gateway_pb2.DESCRIPTOR.services_by_name["Gateway"].full_name
log = structlog.get_logger("cleave.gateway")


def registration(servicer: GatewayServicer) -> ServiceRegistration:
    return ServiceRegistration(SERVICE_NAME, servicer, gateway_pb2_grpc.add_GatewayServicer_to_server)


class GatewayProcess:
    """The routing backend plus the HTTP server: started before the gRPC server reports
    SERVING, stopped after it drained."""

    def __init__(
        self, backend: RoutingBackend, api: OpenAIApi | None, http_listen: str | None, share_port: bool = False,
        max_connections: int | None = None, http_port_file: Path | None = None, tls: TlsConfig | None = None,
    ) -> None:
        self.backend = backend
        self.api = api
        self.http_listen = http_listen
        self.share_port = share_port
        self.max_connections = max_connections
        self.http_port_file = http_port_file
        self.tls = tls  # the HTTP API serves HTTPS with it
        self._runner: web.AppRunner | None = None

    async def start(self) -> None:
        await self.backend.start()
        if self.api is not None and self.http_listen:
            self._runner = await start_http(self.api, self.http_listen, self.share_port, self.max_connections,
                                            tls=self.tls)
            port = bound_port(self._runner)
            if self.http_port_file is not None:
                write_port_file(self.http_port_file, port)
            log.info("openai http api listening", port=port, scheme="http" if self.tls is None else "https")

    async def shutdown(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
        await self.backend.shutdown()


def build(config: GatewayConfig, tracing: Tracing = TRACING_OFF,
          metrics: ServiceMetrics | None = None) -> tuple[GatewayServicer, GatewayProcess]:
    """The servicer and the process lifecycle for a gateway config (HTTP requests get
    server spans in `tracing`; requests are metered into `metrics`' registry, which the HTTP
    API also serves at /metrics)."""
    metrics = metrics or gateway_metrics(config)
    model = ServedModel(config.model, max_prompt_bytes=config.max_prompt_bytes)
    requests = GatewayMetrics(metrics.registry, metrics.labels, model.max_model_len, tenants=config.tenant_metrics)
    served = replace(config.model, max_context_length=model.max_model_len,
                     is_reasoning_model=model.is_reasoning_model)
    backend = RoutingBackend(
        model, config.prefill_addresses, config.decode_addresses,
        GatewayOptions(
            gateway_id=config.gateway_id, mode=config.mode, store_to_kvstore=config.store_to_kvstore,
            priorities=config.scheduling_policy == "priority",
            policy=DisaggregationPolicy(
                local_max_tokens=config.local_prefill_max_tokens,
                remote_max_queue_tokens=config.remote_prefill_max_queue_tokens,
                remote_idle_tokens=config.remote_prefill_idle_tokens,
                local_max_running=config.local_prefill_max_running,
                remote_busy_max_queue_tokens=config.remote_prefill_busy_max_queue_tokens),
            pool=PoolOptions(internal_token=config.service.internal_token, tls=config.service.tls),
        ),
        observer=requests,
    )
    requests.track_decode_workers(backend.decode_loads)
    capped = config.max_requests_per_key or config.max_samples_per_key
    limited = (TenantLimits(backend, config.max_requests_per_key, config.max_samples_per_key) if capped
               else backend)
    metered = ClientSafeBackend(MeteredBackend(limited, requests))  # what both public APIs reach
    servicer = GatewayServicer(metered, [served], api_keys=config.api_keys)
    token_text = lambda token_id: model.tokenizer.decode([token_id])  # noqa: E731
    api = (OpenAIApi(metered, [served], token_text, tracing=tracing, api_keys=config.api_keys,
                     max_request_bytes=config.max_request_bytes, routability=backend.routability,
                     metrics_registry=metrics.registry, served_model=model)
           if config.http_listen else None)
    return servicer, GatewayProcess(backend, api, config.http_listen, config.share_port,
                                    config.service.rpc.max_connections, config.http_port_file, tls=config.service.tls)


def gateway_metrics(config: GatewayConfig) -> ServiceMetrics:
    """The gateway's registry, labelled with the served model and the gateway id."""
    return ServiceMetrics(MetricLabels(config.model.id, config.gateway_id), config.service.metrics)


def main(argv: list[str] | None = None) -> int:
    config = gateway_config(argv, os.environ)
    configure_logging(config.service.log_level, config.service.log_json)
    tracing = setup_tracing(config.service.tracing)
    metrics = gateway_metrics(config)
    try:
        try:
            servicer, process = build(config, tracing, metrics)
        except ModelNotFound as error:  # one line naming --model, no traceback
            raise SystemExit(f"error: {error}") from None
        # the public service asks for the API key, not the internal token (which it sends to workers)
        # health follows the workers: NOT_SERVING while no request could be routed
        asyncio.run(run_service([registration(servicer)], config.service, process, tracing=tracing,
                                auth=api_key_auth(config.api_keys), readiness=process.backend.routability,
                                work=process.backend, metrics=metrics))
    finally:
        tracing.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
