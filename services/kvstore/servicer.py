"""cleave.v1.KVStore servicer: protobuf <-> `services.kvstore.backend` types, nothing else.

Put and Get carry a block's payload (512 KiB on a 1B model, 16 MiB per 512-token prompt) on
the store's one event loop, where every prefill's Lookup waits its turn. So their KVBlock
messages are not protobuf objects: Put's arrive as wire bytes (`add_to_server` registers it
without a request deserializer) and are read by `decode_kv_block`, the stored payload being a
view of the bytes gRPC delivered; Get's are written by `encode_kv_block`, one copy each.
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator, Iterable
from contextlib import aclosing

import grpc
from google.protobuf.message import DecodeError

from cleave.errors import InvalidArgument
from cleave.proto.cleave.v1 import kvstore_pb2, kvstore_pb2_grpc
from cleave.rpc.convert import DTYPE_ITEMSIZE, dtype_from_proto, dtype_to_proto, kv_layout_from_proto
from cleave.rpc.types import TensorBytes
from cleave.rpc.kvstore_wire import WireKVBlock, decode_kv_block, encode_kv_block
from services.kvstore.backend import KVBlock, KVStoreBackend

MAX_HASH_BYTES = 64
SERVICE_NAME = kvstore_pb2.DESCRIPTOR.services_by_name["KVStore"].full_name


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


def _payload(wire: WireKVBlock, field: str) -> TensorBytes:
    """Validate that data holds exactly prod(shape) elements of dtype (data stays a view)."""
    dtype = dtype_from_proto(wire.dtype, f"{field}.dtype")
    if any(size < 0 for size in wire.shape):
        raise InvalidArgument(f"negative dimension in {list(wire.shape)}", field=f"{field}.shape")
    expected = math.prod(wire.shape) * DTYPE_ITEMSIZE[dtype]
    if wire.data.nbytes != expected:
        raise InvalidArgument(
            f"holds {wire.data.nbytes} bytes but shape {list(wire.shape)} of {dtype} needs {expected}",
            field=f"{field}.data")
    return TensorBytes(dtype=dtype, shape=wire.shape, data=wire.data)


def block_from_wire(message: bytes, field: str) -> KVBlock:
    """A validated block from a KVBlock's wire bytes; its payload views `message`."""
    try:
        wire = decode_kv_block(message)
    except DecodeError as exc:
        raise InvalidArgument(f"is not a cleave.v1.KVBlock message: {exc}", field=field) from exc
    (block_hash,) = _hashes((wire.hash,), field=f"{field}.hash")
    if len(wire.parent_hash) > MAX_HASH_BYTES:
        raise InvalidArgument(f"must be at most {MAX_HASH_BYTES} bytes", field=f"{field}.parent_hash")
    if not wire.has_payload:
        raise InvalidArgument("must hold the block's KV", field=f"{field}.payload")
    return KVBlock(
        hash=block_hash,
        parent_hash=wire.parent_hash,
        layout_id=_layout_id(wire.layout_id, f"{field}.layout_id"),
        payload=_payload(wire, f"{field}.payload"),
    )


def block_to_wire(block: KVBlock) -> bytes:
    """A block's KVBlock wire bytes (the payload copied once)."""
    payload = block.payload
    return encode_kv_block(block.hash, block.parent_hash, block.layout_id, dtype_to_proto(payload.dtype),
                           payload.shape, memoryview(payload.data))


async def _blocks_from_stream(stream: AsyncIterator[bytes]) -> AsyncIterator[KVBlock]:
    position = 0
    async for message in stream:
        yield block_from_wire(message, f"blocks[{position}]")
        position += 1


def add_to_server(servicer: KVStoreServicer, server: grpc.aio.Server) -> None:
    """`kvstore_pb2_grpc.add_KVStoreServicer_to_server`, except that Put receives and Get
    sends KVBlock wire bytes (no protobuf objects; see the module docstring)."""
    handlers = {
        "Connect": grpc.unary_unary_rpc_method_handler(
            servicer.Connect, request_deserializer=kvstore_pb2.ConnectRequest.FromString,
            response_serializer=kvstore_pb2.ConnectResponse.SerializeToString),
        "Lookup": grpc.unary_unary_rpc_method_handler(
            servicer.Lookup, request_deserializer=kvstore_pb2.LookupRequest.FromString,
            response_serializer=kvstore_pb2.LookupResponse.SerializeToString),
        "Put": grpc.stream_unary_rpc_method_handler(
            servicer.Put, response_serializer=kvstore_pb2.PutResponse.SerializeToString),
        "Get": grpc.unary_stream_rpc_method_handler(
            servicer.Get, request_deserializer=kvstore_pb2.GetRequest.FromString),
        "Stats": grpc.unary_unary_rpc_method_handler(
            servicer.Stats, request_deserializer=kvstore_pb2.StatsRequest.FromString,
            response_serializer=kvstore_pb2.StatsResponse.SerializeToString),
        "Watch": grpc.unary_stream_rpc_method_handler(
            servicer.Watch, request_deserializer=kvstore_pb2.WatchRequest.FromString,
            response_serializer=kvstore_pb2.BlockEvents.SerializeToString),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
    server.add_registered_method_handlers(SERVICE_NAME, handlers)


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
        self, request_iterator: AsyncIterator[bytes], context: grpc.aio.ServicerContext
    ) -> kvstore_pb2.PutResponse:
        result = await self.backend.put(_blocks_from_stream(request_iterator))
        return kvstore_pb2.PutResponse(
            num_stored=result.num_stored, num_already_present=result.num_already_present
        )

    async def Get(
        self, request: kvstore_pb2.GetRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[bytes]:
        blocks = self.backend.get(_layout_id(request.layout_id), _hashes(request.block_hashes))
        async for block in blocks:
            yield block_to_wire(block)

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
            num_lookups=stats.num_lookups,
        )

    async def Watch(
        self, request: kvstore_pb2.WatchRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[kvstore_pb2.BlockEvents]:
        # aclosing: the watcher leaves the store when the call ends, also when it is cancelled
        async with aclosing(self.backend.watch(_layout_id(request.layout_id))) as events:
            async for event in events:
                yield kvstore_pb2.BlockEvents(
                    stored_hashes=event.stored, removed_hashes=event.removed, snapshot_done=event.snapshot_done)
