"""Sending end of KV transfers: `KVTransferClient.open(handle)` -> `KVSender`.

A prefill worker keeps one `KVTransferClient` (bulk connections by receiver address, opened
CUDA IPC caches, NCCL communicators by peer, one copy stream per device) and opens one
`KVSender` per request. The sender moves the K and V of its blocks into the receiver's
reserved blocks, one layer or a run of layers at a time (`send_layers`):
  - CUDA_IPC: on the copy stream, after the producer's event, one fused block-copy launch for
    the whole run into the receiver's mapped cache; a `FramePump` writes the header (no
    bytes) once the copy's event completed, merging runs that finished together. Nothing
    waits per layer: `send_layers` returns at once, and only the pump waits on the copy's
    event (not on the device, and not on the receiver);
  - NCCL: gather on the communicator's stream after the producer's event, header, then
    `ncclSend` of the chunk; the stream keeps the order, no host wait per layer;
  - TCP: gather `[2, n, BS, Hkv, D]`, stage through pinned memory when on CUDA, write
    header + raw bytes.
Calling `send_layers` right after a layer's forward overlaps the transfer with the next
layers; `finish` flushes the frames and waits, once, for the receiver's verdict.

Where the KV comes from (`ready`): "current_stream" (default) orders the copy after the work
queued on the caller's current stream; a `torch.cuda.Event` after that event; "complete"
when the producer already synchronized (e.g. the engine step that wrote the KV has returned
its sampled tokens to the host), so the copy starts at once.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import Literal, Union

import torch

from cleave.device_copy import tensor_on, to_host
from cleave.errors import DeadlineExceeded, FailedPrecondition, InvalidArgument
from cleave.proto.cleave.v1 import common_pb2
from cleave.rpc.convert import dtype_to_proto
from cleave.rpc.types import TransferHandle, TransferStats, TransportKind
from cleave.transfer.block_copy import copy_blocks
from cleave.transfer.connection import BulkConnection
from cleave.transfer.cuda_ipc import IpcCacheMap
from cleave.transfer.frame_pump import EventCompletion, FramePump
from cleave.transfer.layer_frames import LayerLedger
from cleave.transfer.layout import check_layout
from cleave.transfer.nccl import NcclCommunicator
from cleave.transfer.tensors import (
    as_bytes,
    check_kv_cache,
    device_index,
    dtype_name,
    gather_layer,
    layer_chunk_shape,
)

Ready = Union[torch.cuda.Event, Literal["current_stream", "complete"]]


class KVSender:
    """Sends one transfer's KV, a layer or a run of layers at a time, into the blocks a
    TransferHandle reserved."""

    def __init__(self, client: KVTransferClient, handle: TransferHandle, connection: BulkConnection) -> None:
        self.handle = handle
        self._client = client
        self._connection = connection
        self._result = connection.result(handle.transfer_id)
        self._dst_ids = handle.block_ids[handle.num_cached_blocks:]
        self._ledger: LayerLedger | None = None
        self._num_bytes = 0
        self._started = time.perf_counter()
        self._index_cache: dict[tuple, torch.Tensor] = {}
        self._pair_cache: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}  # CUDA IPC (source, destination)
        self._pump: FramePump | None = None  # CUDA_IPC frames, written as copies finish
        self._num_layers_framed = 0  # CUDA_IPC: layers whose frame was written
        self._cache: torch.Tensor | None = None
        self._ids_sent = False  # the first header names the blocks; later ones leave them out

    @property
    def num_blocks(self) -> int:
        """Blocks this transfer moves (the handle's, minus the receiver's cached prefix)."""
        return len(self._dst_ids)

    @property
    def num_frames(self) -> int:
        """CUDA IPC control frames written so far (runs of layers merge into one)."""
        return self._pump.num_frames if self._pump is not None else 0

    def _source_ids(self, block_ids: Sequence[int]) -> tuple[int, ...]:
        if len(block_ids) == len(self.handle.block_ids):
            return tuple(block_ids[self.handle.num_cached_blocks:])
        if len(block_ids) == len(self._dst_ids):
            return tuple(block_ids)
        raise InvalidArgument(
            f"got {len(block_ids)} source blocks for {len(self.handle.block_ids)} reserved "
            f"({self.handle.num_cached_blocks} cached)", field="block_ids")

    def _index(self, ids: Sequence[int], device: torch.device, stream: torch.cuda.Stream | None = None) -> torch.Tensor:
        """Block ids as an index tensor on `device`; on CUDA copied on `stream` from pinned
        memory, so building it never waits for the device."""
        key = (tuple(ids), device, stream)
        if key not in self._index_cache:
            self._index_cache[key] = device_index(ids, device, stream)
        return self._index_cache[key]

    def _pair_index(self, src_ids: tuple[int, ...], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Source and destination block ids as two index tensors staged in one host-to-device
        copy on the current stream (built once per source-id sequence)."""
        key = (src_ids, device)
        pair = self._pair_cache.get(key)
        if pair is None:
            both = tensor_on([*src_ids, *self._dst_ids], torch.int64, device)  # [2n]
            pair = self._pair_cache[key] = (both[: len(src_ids)], both[len(src_ids):])
        return pair

    def _check(self, layers: range, cache: torch.Tensor) -> LayerLedger:
        if self._result.done():
            self._result.result()  # the receiver already refused: raise its error
        deadline = self.handle.deadline_unix_s
        if deadline is not None and time.time() > deadline:
            raise DeadlineExceeded(f"transfer {self.handle.transfer_id!r} is past its deadline")
        if self._ledger is None:
            check_kv_cache(cache)
            if self.handle.layout is not None:
                check_layout(self.handle.layout, cache)
            self._ledger = LayerLedger(cache.shape[0])
            self._cache = cache
        self._ledger.check(layers)
        return self._ledger

    def _header(self, layers: range, cache: torch.Tensor, byte_length: int, is_last: bool) -> common_pb2.KVChunkHeader:
        header = common_pb2.KVChunkHeader(
            transfer_id=self.handle.transfer_id, layer_index=layers.start, num_layers=len(layers),
            dtype=dtype_to_proto(dtype_name(cache.dtype)),
            shape=layer_chunk_shape(cache, len(self._dst_ids), len(layers)), byte_length=byte_length,
            is_last=is_last,
        )
        if not self._ids_sent:
            header.block_ids.extend(self._dst_ids)
            self._ids_sent = True
        return header

    async def send_layer(self, layer: int, cache: torch.Tensor, block_ids: Sequence[int],
                         ready: Ready = "current_stream") -> None:
        """Send one layer's K and V of `block_ids` (see `send_layers`)."""
        await self.send_layers(range(layer, layer + 1), cache, block_ids, ready)

    async def send_layers(self, layers: range, cache: torch.Tensor, block_ids: Sequence[int],
                          ready: Ready = "current_stream") -> None:
        """Send the K and V of `block_ids` (the sender's blocks, prompt order) of a run of
        layers. On CUDA IPC and NCCL it returns once the work is queued; `finish` waits.

        cache: [L, 2, NB, BS, Hkv, D]; block_ids: one per handle block, or one per block
        after the receiver's cached prefix; ready: see the module docstring.
        """
        ledger = self._check(layers, cache)
        src_ids = self._source_ids(block_ids)
        transport = self.handle.transport
        is_last = ledger.completes(layers)
        if transport is TransportKind.TCP:
            await self._send_tcp(layers, cache, src_ids, is_last)
        elif transport is TransportKind.CUDA_IPC:
            self._send_cuda_ipc(layers, cache, src_ids, ready, is_last)
        else:
            await self._send_nccl(layers, cache, src_ids, ready, is_last)
        ledger.add(layers)
        self._num_bytes += cache.element_size() * 2 * len(layers) * len(src_ids) * cache[0, 0, 0].numel()

    async def _send_tcp(self, layers: range, cache: torch.Tensor, src_ids: tuple[int, ...], is_last: bool) -> None:
        for layer in layers:
            chunk = gather_layer(cache, layer, self._index(src_ids, cache.device))  # [2, n, BS, Hkv, D]
            if chunk.is_cuda:
                host = to_host(chunk)
                await _wait_stream(torch.cuda.current_stream(chunk.device))
                chunk = host
            payload = as_bytes(chunk)
            header = self._header(range(layer, layer + 1), cache, len(payload), is_last and layer == layers[-1])
            async with self._connection.lock:
                await self._connection.write_chunk(header, payload)

    def _send_cuda_ipc(self, layers: range, cache: torch.Tensor, src_ids: tuple[int, ...], ready: Ready,
                       is_last: bool) -> None:
        if not cache.is_cuda:
            raise FailedPrecondition("the CUDA IPC transport needs a CUDA KV cache")
        dst = self._client.ipc_caches.open(self.handle.cuda_ipc_handle)
        if dst.shape[0] != cache.shape[0] or dst.shape[3:] != cache.shape[3:] or dst.dtype != cache.dtype:
            raise FailedPrecondition(
                f"receiver cache {dst.dtype} {list(dst.shape)} does not match {cache.dtype} {list(cache.shape)}")
        stream = self._client.copy_stream(cache.device)
        _order_after(stream, ready, cache.device)
        with torch.cuda.stream(stream):
            src_index, dst_index = self._pair_index(src_ids, cache.device)
            copy_blocks(cache, dst, src_index, dst_index, layers)
            done = torch.cuda.Event()
            done.record(stream)
        if self._pump is None:
            self._pump = FramePump(self._write_ipc_frame)
        # The receiver reads the blocks once the header arrives: the pump writes it after `done`.
        self._pump.submit(layers, EventCompletion(done))

    async def _write_ipc_frame(self, layers: range) -> None:
        assert self._cache is not None and self._ledger is not None
        self._num_layers_framed += len(layers)
        is_last = self._num_layers_framed == self._ledger.num_layers
        async with self._connection.lock:
            await self._connection.write_chunk(self._header(layers, self._cache, 0, is_last))

    async def _send_nccl(self, layers: range, cache: torch.Tensor, src_ids: tuple[int, ...], ready: Ready,
                         is_last: bool) -> None:
        comm = self._client.nccl_peer(self.handle.address)
        stream = comm.stream
        _order_after(stream, ready, cache.device)
        index = self._index(src_ids, cache.device, stream)
        for layer in layers:
            with torch.cuda.stream(stream):
                chunk = gather_layer(cache, layer, index)  # [2, n, BS, Hkv, D], freed in stream order
            header = self._header(range(layer, layer + 1), cache, 0, is_last and layer == layers[-1])
            # Header and send under one lock: the receiver posts its receives in header order.
            async with self._connection.lock:
                await self._connection.write_chunk(header)
                with torch.cuda.stream(stream):
                    comm.send(chunk, peer=1 - comm.rank)

    async def send_all(self, cache: torch.Tensor, block_ids: Sequence[int],
                       timeout_s: float | None = None, ready: Ready = "current_stream") -> TransferStats:
        """Send every layer (on CUDA IPC: one copy launch, one frame), then wait for the
        receiver's verdict."""
        await self.send_layers(range(cache.shape[0]), cache, block_ids, ready)
        return await self.finish(timeout_s)

    async def finish(self, timeout_s: float | None = None) -> TransferStats:
        """Write the remaining frames and wait until the receiver confirms every layer
        (default: until the handle's deadline).

        Raises DeadlineExceeded on timeout, or the receiver's error when it refused."""
        if self._ledger is None or not self._ledger.is_complete:
            sent = self._ledger.num_done if self._ledger else 0
            raise FailedPrecondition(
                f"{sent} layers sent of {self._ledger.num_layers if self._ledger else None}; send them all first")
        if timeout_s is None and self.handle.deadline_unix_s is not None:
            timeout_s = max(0.0, self.handle.deadline_unix_s - time.time())
        try:
            if self._pump is not None:
                await self._pump.flush()
            await asyncio.wait_for(asyncio.shield(self._result), timeout_s)
        except asyncio.TimeoutError:
            raise DeadlineExceeded(
                f"receiver did not confirm transfer {self.handle.transfer_id!r} in time") from None
        finally:
            self._connection.forget(self.handle.transfer_id)
        return TransferStats(transport=self.handle.transport, num_bytes=self._num_bytes,
                             seconds=time.perf_counter() - self._started, num_blocks=self.num_blocks)

    async def close(self) -> None:
        """Stop sending; returns once no queued copy reads the source blocks or writes the
        receiver's any more (call before freeing the source blocks after a failure)."""
        if self._pump is not None:
            await self._pump.close()
        stream = self._client.nccl_stream(self.handle.address) if self.handle.transport is TransportKind.NCCL else None
        if stream is not None:
            await _wait_stream(stream)
        self._connection.forget(self.handle.transfer_id)


class KVTransferClient:
    """A worker's sending side: bulk connections, mapped CUDA IPC caches, NCCL peers."""

    def __init__(self) -> None:
        self._connections: dict[str, BulkConnection] = {}
        self._connecting: dict[str, asyncio.Lock] = {}
        self._nccl: dict[str, NcclCommunicator] = {}
        self._copy_streams: dict[torch.device, torch.cuda.Stream] = {}
        self.ipc_caches = IpcCacheMap()

    def copy_stream(self, device: torch.device) -> torch.cuda.Stream:
        """The stream CUDA IPC copies run on (one per device, apart from the engine's)."""
        stream = self._copy_streams.get(device)
        if stream is None:
            stream = self._copy_streams[device] = torch.cuda.Stream(device)
        return stream

    def nccl_stream(self, address: str) -> torch.cuda.Stream | None:
        comm = self._nccl.get(address)
        return comm.stream if comm is not None else None

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


def _order_after(stream: torch.cuda.Stream, ready: Ready, device: torch.device) -> None:
    """Make work queued next on `stream` start after the KV's producer (a device-side wait)."""
    if isinstance(ready, torch.cuda.Event):
        stream.wait_event(ready)
    elif ready == "current_stream":
        stream.wait_stream(torch.cuda.current_stream(device))
    elif ready != "complete":
        raise InvalidArgument(f"ready must be a CUDA event, 'current_stream' or 'complete', not {ready!r}", field="ready")
