"""Sending end of KV transfers: `KVTransferClient.open(handle)` -> `KVSender`.

A prefill worker keeps one `KVTransferClient` (bulk connections by receiver address, opened
CUDA IPC caches, NCCL communicators by peer) and opens one `KVSender` per request. The
sender moves, per layer, the K and V of its blocks into the receiver's reserved blocks:
  - TCP: gather `[2, n, BS, Hkv, D]` (`index_select`), stage through pinned memory when on
    CUDA, write header + raw bytes;
  - CUDA_IPC: one fused block-copy kernel into the receiver's mapped cache, then a header
    with no bytes once the copy finished;
  - NCCL: gather on the communicator's stream, header, then `ncclSend` of the chunk.
`send_layer` right after a layer's forward overlaps the transfer with the next layers;
`finish` waits for the receiver's verdict.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence

import torch

from cleave.errors import DeadlineExceeded, FailedPrecondition, InvalidArgument
from cleave.proto.cleave.v1 import common_pb2
from cleave.rpc.convert import dtype_to_proto
from cleave.rpc.types import TransferHandle, TransferStats, TransportKind
from cleave.transfer.block_copy import copy_blocks
from cleave.transfer.connection import BulkConnection
from cleave.transfer.cuda_ipc import IpcCacheMap
from cleave.transfer.layout import check_layout
from cleave.transfer.nccl import NcclCommunicator
from cleave.transfer.tensors import (
    as_bytes,
    block_index,
    check_kv_cache,
    dtype_name,
    gather_layer,
    layer_chunk_shape,
)


class KVSender:
    """Sends one transfer's KV, layer by layer, into the blocks a TransferHandle reserved."""

    def __init__(self, client: KVTransferClient, handle: TransferHandle, connection: BulkConnection) -> None:
        self.handle = handle
        self._client = client
        self._connection = connection
        self._result = connection.result(handle.transfer_id)
        self._dst_ids = handle.block_ids[handle.num_cached_blocks:]
        self._layers_sent: set[int] = set()
        self._num_layers: int | None = None
        self._num_bytes = 0
        self._started = time.perf_counter()
        self._index_cache: dict[tuple, torch.Tensor] = {}

    @property
    def num_blocks(self) -> int:
        """Blocks this transfer moves (the handle's, minus the receiver's cached prefix)."""
        return len(self._dst_ids)

    def _source_ids(self, block_ids: Sequence[int]) -> tuple[int, ...]:
        if len(block_ids) == len(self.handle.block_ids):
            return tuple(block_ids[self.handle.num_cached_blocks:])
        if len(block_ids) == len(self._dst_ids):
            return tuple(block_ids)
        raise InvalidArgument(
            f"got {len(block_ids)} source blocks for {len(self.handle.block_ids)} reserved "
            f"({self.handle.num_cached_blocks} cached)", field="block_ids")

    def _index(self, ids: Sequence[int], device: torch.device) -> torch.Tensor:
        key = (tuple(ids), device)
        if key not in self._index_cache:
            self._index_cache[key] = block_index(ids, device)
        return self._index_cache[key]

    def _check(self, layer: int, cache: torch.Tensor) -> None:
        if self._result.done():
            self._result.result()  # the receiver already refused: raise its error
        deadline = self.handle.deadline_unix_s
        if deadline is not None and time.time() > deadline:
            raise DeadlineExceeded(f"transfer {self.handle.transfer_id!r} is past its deadline")
        if self._num_layers is None:
            check_kv_cache(cache)
            if self.handle.layout is not None:
                check_layout(self.handle.layout, cache)
            self._num_layers = cache.shape[0]
        if not 0 <= layer < self._num_layers:
            raise InvalidArgument(f"layer {layer} outside [0, {self._num_layers})", field="layer")
        if layer in self._layers_sent:
            raise InvalidArgument(f"layer {layer} was already sent", field="layer")

    def _header(self, layer: int, cache: torch.Tensor, byte_length: int) -> common_pb2.KVChunkHeader:
        return common_pb2.KVChunkHeader(
            transfer_id=self.handle.transfer_id, layer_index=layer, block_ids=self._dst_ids,
            dtype=dtype_to_proto(dtype_name(cache.dtype)),
            shape=layer_chunk_shape(cache, len(self._dst_ids)), byte_length=byte_length,
            is_last=len(self._layers_sent) + 1 == self._num_layers,
        )

    async def send_layer(self, layer: int, cache: torch.Tensor, block_ids: Sequence[int]) -> None:
        """Send one layer's K and V of `block_ids` (the sender's blocks, prompt order).

        cache: [L, 2, NB, BS, Hkv, D]; block_ids: one per handle block, or one per block
        after the receiver's cached prefix.
        """
        self._check(layer, cache)
        src_ids = self._source_ids(block_ids)
        transport = self.handle.transport
        if transport is TransportKind.TCP:
            await self._send_tcp(layer, cache, src_ids)
        elif transport is TransportKind.CUDA_IPC:
            await self._send_cuda_ipc(layer, cache, src_ids)
        else:
            await self._send_nccl(layer, cache, src_ids)
        self._layers_sent.add(layer)
        self._num_bytes += cache.element_size() * 2 * len(src_ids) * cache[0, 0, 0].numel()

    async def _send_tcp(self, layer: int, cache: torch.Tensor, src_ids: tuple[int, ...]) -> None:
        chunk = gather_layer(cache, layer, self._index(src_ids, cache.device))  # [2, n, BS, Hkv, D]
        if chunk.is_cuda:
            host = torch.empty(chunk.shape, dtype=chunk.dtype, pin_memory=True)
            host.copy_(chunk, non_blocking=True)
            await _wait_stream(torch.cuda.current_stream(chunk.device))
            chunk = host
        payload = as_bytes(chunk)
        async with self._connection.lock:
            await self._connection.write_chunk(self._header(layer, cache, len(payload)), payload)

    async def _send_cuda_ipc(self, layer: int, cache: torch.Tensor, src_ids: tuple[int, ...]) -> None:
        if not cache.is_cuda:
            raise FailedPrecondition("the CUDA IPC transport needs a CUDA KV cache")
        dst = self._client.ipc_caches.open(self.handle.cuda_ipc_handle)
        if dst.shape[0] != cache.shape[0] or dst.shape[3:] != cache.shape[3:] or dst.dtype != cache.dtype:
            raise FailedPrecondition(
                f"receiver cache {dst.dtype} {list(dst.shape)} does not match {cache.dtype} {list(cache.shape)}")
        copy_blocks(cache, dst, self._index(src_ids, cache.device),
                    self._index(self._dst_ids, cache.device), range(layer, layer + 1))
        # The receiver reads the blocks once the header arrives: the copy must be done.
        await _wait_stream(torch.cuda.current_stream(cache.device))
        async with self._connection.lock:
            await self._connection.write_chunk(self._header(layer, cache, 0))

    async def _send_nccl(self, layer: int, cache: torch.Tensor, src_ids: tuple[int, ...]) -> None:
        comm = self._client.nccl_peer(self.handle.address)
        stream = comm.stream
        stream.wait_stream(torch.cuda.current_stream(cache.device))  # the layer was computed
        with torch.cuda.stream(stream):
            chunk = gather_layer(cache, layer, self._index(src_ids, cache.device))
        # Header and send under one lock: the receiver posts its receives in header order.
        async with self._connection.lock:
            await self._connection.write_chunk(self._header(layer, cache, 0))
            with torch.cuda.stream(stream):
                comm.send(chunk, peer=1 - comm.rank)
        await _wait_stream(stream)

    async def send_all(self, cache: torch.Tensor, block_ids: Sequence[int],
                       timeout_s: float | None = None) -> TransferStats:
        """Send every layer, then wait for the receiver's verdict."""
        for layer in range(cache.shape[0]):
            await self.send_layer(layer, cache, block_ids)
        return await self.finish(timeout_s)

    async def finish(self, timeout_s: float | None = None) -> TransferStats:
        """Wait until the receiver confirms every layer (default: until the handle's deadline).

        Raises DeadlineExceeded on timeout, or the receiver's error when it refused."""
        if self._num_layers is None or len(self._layers_sent) != self._num_layers:
            raise FailedPrecondition(
                f"{len(self._layers_sent)} layers sent of {self._num_layers}; send them all first")
        if timeout_s is None and self.handle.deadline_unix_s is not None:
            timeout_s = max(0.0, self.handle.deadline_unix_s - time.time())
        try:
            await asyncio.wait_for(asyncio.shield(self._result), timeout_s)
        except asyncio.TimeoutError:
            raise DeadlineExceeded(
                f"receiver did not confirm transfer {self.handle.transfer_id!r} in time") from None
        finally:
            self._connection.forget(self.handle.transfer_id)
        return TransferStats(transport=self.handle.transport, num_bytes=self._num_bytes,
                             seconds=time.perf_counter() - self._started, num_blocks=self.num_blocks)


class KVTransferClient:
    """A worker's sending side: bulk connections, mapped CUDA IPC caches, NCCL peers."""

    def __init__(self) -> None:
        self._connections: dict[str, BulkConnection] = {}
        self._connecting: dict[str, asyncio.Lock] = {}
        self._nccl: dict[str, NcclCommunicator] = {}
        self.ipc_caches = IpcCacheMap()

    def add_nccl_peer(self, address: str, comm: NcclCommunicator) -> None:
        """Use `comm` for NCCL transfers to the receiver whose bulk endpoint is `address`."""
        self._nccl[address] = comm

    def nccl_peer(self, address: str) -> NcclCommunicator:
        if address not in self._nccl:
            raise FailedPrecondition(f"no NCCL communicator with {address}; handshake first")
        return self._nccl[address]

    async def _connection(self, address: str) -> BulkConnection:
        lock = self._connecting.setdefault(address, asyncio.Lock())
        async with lock:
            connection = self._connections.get(address)
            if connection is None or connection.is_closed:
                connection = self._connections[address] = await BulkConnection.open(address)
            return connection

    async def open(self, handle: TransferHandle) -> KVSender:
        """A sender for one transfer (connects to the receiver on first use)."""
        if not handle.address:
            raise InvalidArgument("the transfer handle names no receiver address", field="address")
        if handle.transport is TransportKind.CUDA_IPC and not handle.cuda_ipc_handle:
            raise InvalidArgument("CUDA IPC transfers need the receiver's handle", field="cuda_ipc_handle")
        if handle.transport is TransportKind.NCCL:
            self.nccl_peer(handle.address)
        return KVSender(self, handle, await self._connection(handle.address))

    async def close(self) -> None:
        for connection in self._connections.values():
            await connection.close()
        self._connections.clear()
        self.ipc_caches.clear()


async def _wait_stream(stream: torch.cuda.Stream) -> None:
    """Wait for the work queued on `stream` so far without blocking the event loop."""
    event = torch.cuda.Event()
    event.record(stream)
    await asyncio.to_thread(event.synchronize)
