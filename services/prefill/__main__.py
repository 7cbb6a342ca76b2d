"""`python -m services.prefill`: config, then serve."""

from __future__ import annotations

import asyncio
import os
import sys

from cleave.config import worker_config
from cleave.logging import configure_logging
from cleave.metrics import PrefillTransferMetrics
from cleave.metrics.worker import worker_metrics
from cleave.proto.cleave.v1 import prefill_pb2, prefill_pb2_grpc
from cleave.rpc import ServiceRegistration, run_service
from cleave.rpc.auth import internal_auth
from cleave.tracing import setup_tracing
from cleave.worker import FreezeAfterStart, engine_config_from_worker
from services.prefill.backend import PrefillBackend
from services.prefill.engine_backend import EnginePrefillBackend
from services.prefill.servicer import PrefillServicer

SERVICE_NAME = prefill_pb2.DESCRIPTOR.services_by_name["Prefill"].full_name


def registration(servicer: PrefillServicer) -> ServiceRegistration:
    return ServiceRegistration(SERVICE_NAME, servicer, prefill_pb2_grpc.add_PrefillServicer_to_server)


def main(argv: list[str] | None = None) -> int:
    config = worker_config("prefill", argv, os.environ)
    configure_logging(config.service.log_level, config.service.log_json)
    tracing = setup_tracing(config.service.tracing)
    backend: PrefillBackend = EnginePrefillBackend(
        engine_config_from_worker(config),
        worker_id=config.worker_id,
        model_id=config.model.id,
        kvstore_address=config.kvstore_address,
        kvstore_min_prefix_tokens=config.kvstore_min_prefix_tokens,
        layer_streaming=config.layer_streaming,  # type: ignore[arg-type]
        internal_token=config.service.internal_token,
        tls=config.service.tls,
    )
    servicer = PrefillServicer(backend, config.model.id)
    # Model and engine objects live as long as the process: out of the collector's walks.
    lifecycle = FreezeAfterStart(backend, config.worker_id)
    lifecycle, metrics = worker_metrics(config, lifecycle, lambda: backend.engine)  # type: ignore[attr-defined]
    if metrics is not None:
        PrefillTransferMetrics(metrics.registry, metrics.labels, lambda: backend.counters,  # type: ignore[attr-defined]
                               lambda: backend.negotiator)  # type: ignore[attr-defined]
    try:
        asyncio.run(run_service([registration(servicer)], config.service, lifecycle, tracing=tracing,
                                auth=internal_auth(config.service.internal_token), work=backend,
                                metrics=metrics, fatal=backend.failed))
    finally:
        tracing.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
