"""`python -m services.decode`: config, then serve."""

from __future__ import annotations

import asyncio
import os
import sys

from cleave.config import worker_config
from cleave.logging import configure_logging
from cleave.metrics.worker import worker_metrics
from cleave.proto.cleave.v1 import decode_pb2, decode_pb2_grpc
from cleave.rpc import ServiceRegistration, run_service
from cleave.rpc.auth import internal_auth
from cleave.tracing import setup_tracing
from cleave.worker import FreezeAfterStart, engine_config_from_worker
from services.decode.engine_backend import EngineDecodeBackend
from services.decode.servicer import DecodeServicer

SERVICE_NAME = decode_pb2.DESCRIPTOR.services_by_name["Decode"].full_name


def registration(servicer: DecodeServicer) -> ServiceRegistration:
    return ServiceRegistration(SERVICE_NAME, servicer, decode_pb2_grpc.add_DecodeServicer_to_server)


def main(argv: list[str] | None = None) -> int:
    config = worker_config("decode", argv, os.environ)
    configure_logging(config.service.log_level, config.service.log_json)
    tracing = setup_tracing(config.service.tracing)
    backend = EngineDecodeBackend(
        engine_config_from_worker(config),
        worker_id=config.worker_id,
        model_id=config.model.id,
        transfer_listen=config.kv_listen,
        transfer_timeout_s=config.transfer_timeout_s,
        internal_token=config.service.internal_token,
        tls=config.service.tls,
        max_queued_admissions=config.max_queued_admissions,
    )
    servicer = DecodeServicer(backend)
    # Model and engine objects live as long as the process: out of the collector's walks.
    lifecycle = FreezeAfterStart(backend, config.worker_id)
    lifecycle, metrics = worker_metrics(config, lifecycle, lambda: backend.engine)  # type: ignore[attr-defined]
    # Prefill workers find this address in the handles and call Handshake there.
    try:
        asyncio.run(run_service([registration(servicer)], config.service, lifecycle,
                                on_listening=backend.set_control_address, tracing=tracing,
                                auth=internal_auth(config.service.internal_token), work=backend,
                                metrics=metrics, fatal=backend.failed))
    finally:
        tracing.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
