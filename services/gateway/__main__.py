"""`python -m services.gateway`: config, then serve."""

from __future__ import annotations

import asyncio
import os
import sys

import structlog

from cleave.config import gateway_config
from cleave.logging import configure_logging
from cleave.proto.cleave.v1 import gateway_pb2, gateway_pb2_grpc
from cleave.rpc import ServiceRegistration, run_service
from services.gateway.backend import GatewayBackend, UnwiredGatewayBackend
from services.gateway.servicer import GatewayServicer

SERVICE_NAME = gateway_pb2.DESCRIPTOR.services_by_name["Gateway"].full_name


def registration(servicer: GatewayServicer) -> ServiceRegistration:
    return ServiceRegistration(SERVICE_NAME, servicer, gateway_pb2_grpc.add_GatewayServicer_to_server)


def main(argv: list[str] | None = None) -> int:
    config = gateway_config(argv, os.environ)
    configure_logging(config.service.log_level, config.service.log_json)
    if config.http_listen:
        structlog.get_logger("cleave.gateway").warning(
            "the OpenAI-compatible HTTP API is not part of this build yet; serving gRPC only",
            http_listen=config.http_listen,
        )
    backend: GatewayBackend = UnwiredGatewayBackend()
    servicer = GatewayServicer(backend, [config.model])
    asyncio.run(run_service([registration(servicer)], config.service, backend))
    return 0


if __name__ == "__main__":
    sys.exit(main())
