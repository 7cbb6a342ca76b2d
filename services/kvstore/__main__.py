"""`python -m services.kvstore`: config, then serve."""

from __future__ import annotations

import asyncio
import os
import sys

from cleave.config import kvstore_config
from cleave.logging import configure_logging
from cleave.metrics import KVStoreMetrics, MetricLabels, ServiceMetrics
from cleave.rpc import ServiceRegistration, run_service
from cleave.rpc.auth import internal_auth
from cleave.tracing import setup_tracing
from services.kvstore.servicer import SERVICE_NAME, KVStoreServicer, add_to_server
from services.kvstore.store import BlockStore, StoreConfig


def registration(servicer: KVStoreServicer) -> ServiceRegistration:
    return ServiceRegistration(SERVICE_NAME, servicer, add_to_server)


def main(argv: list[str] | None = None) -> int:
    config = kvstore_config(argv, os.environ)
    configure_logging(config.service.log_level, config.service.log_json)
    tracing = setup_tracing(config.service.tracing)
    backend = BlockStore(
        StoreConfig(ram_bytes=config.ram_bytes, disk_path=config.disk_path, disk_bytes=config.disk_bytes)
    )
    servicer = KVStoreServicer(backend)
    metrics = None
    if config.service.metrics is not None:  # the store serves any model's layout: no model_name
        metrics = ServiceMetrics(MetricLabels("", "kvstore"), config.service.metrics)
        KVStoreMetrics(metrics.registry, metrics.labels, backend.stats)  # type: ignore[arg-type]
    try:
        asyncio.run(run_service([registration(servicer)], config.service, backend, tracing=tracing,
                                auth=internal_auth(config.service.internal_token), metrics=metrics,
                                work=backend))  # a drain ends the Watch streams first
    finally:
        tracing.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
