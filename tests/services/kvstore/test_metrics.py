"""The kvstore's metrics follow its work: tiers, hits and misses, evictions, checksum failures,
and Put/Get latency from the gRPC series."""

from __future__ import annotations

from pathlib import Path

from prometheus_client import CollectorRegistry

from cleave.metrics import KVStoreMetrics, MetricLabels
from cleave.metrics.grpc_server import GrpcServerMetrics
from cleave.rpc import serve
from cleave.rpc.metrics_interceptor import MetricsInterceptor
from cleave.transfer.kvstore_client import KVStoreClient
from services.kvstore.__main__ import registration
from services.kvstore.servicer import KVStoreServicer
from services.kvstore.store import BlockStore, StoreConfig
from tests.services.kvstore.test_store import BLOCK_BYTES, LAYOUT, chain

LABELS = MetricLabels("", "kvstore")


def sample(registry: CollectorRegistry, name: str, **labels: str) -> float | None:
    return registry.get_sample_value(name, {"worker_id": "kvstore", "model_name": "", **labels})


async def test_store_series_move_with_puts_gets_and_corrupt_files(tmp_path: Path):
    config = StoreConfig(ram_bytes=2 * BLOCK_BYTES, disk_path=tmp_path, disk_bytes=4 * BLOCK_BYTES)
    hashes, blocks = chain(5, seed=7)
    registry = CollectorRegistry()
    store = BlockStore(config)
    KVStoreMetrics(registry, LABELS, store.stats)
    await store.start()
    server = await serve([registration(KVStoreServicer(store))], "127.0.0.1:0", handle_signals=False,
                         metrics_interceptor=MetricsInterceptor(GrpcServerMetrics(registry, LABELS)))
    client = KVStoreClient(server.address, client_id="test")
    try:
        await server.set_ready()
        await client.connect(LAYOUT)
        await client.put(hashes, blocks)  # 4 on disk (2 of them cached in RAM), the oldest dropped
        assert sample(registry, "cleave:kvstore_blocks", tier="ram") == 2
        assert sample(registry, "cleave:kvstore_blocks", tier="disk") == 4
        assert sample(registry, "cleave:kvstore_bytes", tier="ram") == 2 * BLOCK_BYTES
        assert sample(registry, "cleave:kvstore_bytes", tier="disk") == 4 * BLOCK_BYTES
        assert sample(registry, "cleave:kvstore_evictions_total") == 1
        assert await client.lookup(hashes[1:]) == 4
        assert await client.lookup(hashes) == 0  # block 0 was dropped: one miss ends the chain
        assert sample(registry, "cleave:kvstore_hits_total") == 4
        assert sample(registry, "cleave:kvstore_misses_total") == 5
        assert sample(registry, "cleave:kvstore_lookups_total") == 2
        await store._disk.flush()  # the disk files are written; corrupt one of them
        path = next(tmp_path.glob(f"blocks/*/{hashes[1].hex()}.kvb"))
        data = bytearray(path.read_bytes())
        data[-1] ^= 0x40
        path.write_bytes(bytes(data))
        got = await client.get(hashes[1:])
        assert got.shape[0] == 0  # the corrupt first block ends the chain
        assert sample(registry, "cleave:kvstore_checksum_failures_total") == 1
        put = {"grpc_service": "cleave.v1.KVStore", "grpc_method": "Put"}
        assert sample(registry, "cleave:grpc_server_handling_seconds_count", **put) == 1
        assert sample(registry, "cleave:grpc_server_handled_total", **put, grpc_code="OK") == 1
        get = {"grpc_service": "cleave.v1.KVStore", "grpc_method": "Get"}
        assert sample(registry, "cleave:grpc_server_handling_seconds_count", **get) == 1
    finally:
        await client.close()
        await server.drain(0)
        await store.shutdown()
