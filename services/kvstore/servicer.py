"""cleave.v1.KVStore servicer: protobuf <-> `services.kvstore.backend` types, nothing else."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable

import grpc

from cleave.errors import InvalidArgument
from cleave.proto.cleave.v1 import kvstore_pb2, kvstore_pb2_grpc
from cleave.rpc.convert import kv_layout_from_proto, tensor_from_proto, tensor_to_proto
from services.kvstore.backend import KVBlock, KVStoreBackend

MAX_HASH_BYTES = 64


def _layout_id(value: str, field: str = "layout_id") -> str:
    if not value:
        raise InvalidArgument("must be set to the id Connect returned", field=field)
    return value


def _hashes(values: Iterable[bytes], field: str = "block_hashes") -> tuple[bytes, ...]:
    hashes = tuple(values)
    if not hashes:
        raise InvalidArgument("must contain at least one hash", field=field)
    for position, value in enumerate(hashes):
        if not value or len(value) > MAX_HASH_BYTES:
            raise InvalidArgument(
                f"must be 1 to {MAX_HASH_BYTES} bytes", field=f"{field}[{position}]"
            )
    return hashes


def block_from_proto(message: kvstore_pb2.KVBlock, field: str) -> KVBlock:
    (block_hash,) = _hashes((message.hash,), field=f"{field}.hash")
    if len(message.parent_hash) > MAX_HASH_BYTES:
        raise InvalidArgument(f"must be at most {MAX_HASH_BYTES} bytes", field=f"{field}.parent_hash")
    if not message.HasField("payload"):
        raise InvalidArgument("must hold the block's KV", field=f"{field}.payload")
    return KVBlock(
        hash=block_hash,
        parent_hash=message.parent_hash,
        layout_id=_layout_id(message.layout_id, f"{field}.layout_id"),
        payload=tensor_from_proto(message.payload, f"{field}.payload"),
    )


def block_to_proto(block: KVBlock) -> kvstore_pb2.KVBlock:
    return kvstore_pb2.KVBlock(
        hash=block.hash,
        parent_hash=block.parent_hash,
        layout_id=block.layout_id,
        payload=tensor_to_proto(block.payload),
    )


async def _blocks_from_stream(stream: AsyncIterator[kvstore_pb2.KVBlock]) -> AsyncIterator[KVBlock]:
    position = 0
    async for message in stream:
        yield block_from_proto(message, f"blocks[{position}]")
        position += 1


class KVStoreServicer(kvstore_pb2_grpc.KVStoreServicer):
    """Validates block-store calls and hands them to a KVStoreBackend."""

    def __init__(self, backend: KVStoreBackend) -> None:
        self.backend = backend

    async def Connect(
        self, request: kvstore_pb2.ConnectRequest, context: grpc.aio.ServicerContext
    ) -> kvstore_pb2.ConnectResponse:
        if not request.HasField("layout"):
            raise InvalidArgument("must describe the caller's KV layout", field="layout")
        result = await self.backend.connect(kv_layout_from_proto(request.layout), request.client_id)
        return kvstore_pb2.ConnectResponse(
            layout_id=result.layout_id, block_num_bytes=result.block_num_bytes
        )

    async def Lookup(
        self, request: kvstore_pb2.LookupRequest, context: grpc.aio.ServicerContext
    ) -> kvstore_pb2.LookupResponse:
        num_hit_blocks = await self.backend.lookup(
            _layout_id(request.layout_id), _hashes(request.block_hashes)
        )
        return kvstore_pb2.LookupResponse(num_hit_blocks=num_hit_blocks)

    async def Put(
        self, request_iterator: AsyncIterator[kvstore_pb2.KVBlock], context: grpc.aio.ServicerContext
    ) -> kvstore_pb2.PutResponse:
        result = await self.backend.put(_blocks_from_stream(request_iterator))
        return kvstore_pb2.PutResponse(
            num_stored=result.num_stored, num_already_present=result.num_already_present
        )

    async def Get(
        self, request: kvstore_pb2.GetRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[kvstore_pb2.KVBlock]:
        blocks = self.backend.get(_layout_id(request.layout_id), _hashes(request.block_hashes))
        async for block in blocks:
            yield block_to_proto(block)

    async def Stats(
        self, request: kvstore_pb2.StatsRequest, context: grpc.aio.ServicerContext
    ) -> kvstore_pb2.StatsResponse:
        stats = self.backend.stats()
        return kvstore_pb2.StatsResponse(
            hits=stats.hits,
            misses=stats.misses,
            bytes_stored=stats.bytes_stored,
            bytes_served=stats.bytes_served,
            evictions=stats.evictions,
            num_blocks_ram=stats.num_blocks_ram,
            num_blocks_disk=stats.num_blocks_disk,
        )
