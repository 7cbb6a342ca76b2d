"""Receiving end of KV transfers: a bulk endpoint (asyncio TCP server) over the receiver's cache.

The decode worker builds one `KVReceiver` over its KV cache, registers every admitted
request with `expect()` (the reserved block ids, a deadline) and hands the returned
`PendingTransfer.handle` to the sender. Chunks arrive per layer or per run of layers
(`KVChunkHeader.num_layers`; framing in `cleave.transfer.framing`):
  - TCP: the chunk's bytes follow its header and are scattered into the reserved blocks;
  - CUDA_IPC: the sender already wrote the blocks through the exported cache handle, the
    header only says which layers landed;
  - NCCL: the header announces the chunk, its bytes arrive over the peer's communicator.
Registering a transfer touches no device (the block index is built on first use, by the
transports that scatter), so Admit never waits for the decode engine's step.
A transfer completes once every layer arrived; then the sender gets a result frame and
`PendingTransfer.wait()` returns. A transfer that is not complete by its deadline fails with
`DeadlineExceeded` (the caller frees its blocks) and later chunks for it are rejected.
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import grpc
import torch

from cleave.errors import CleaveError, DeadlineExceeded, FailedPrecondition, InvalidArgument, NotFound
from cleave.proto.cleave.v1 import common_pb2
from cleave.rpc.convert import dtype_to_proto
from cleave.rpc.errors import error_code_for
from cleave.rpc.types import KVLayout, TransferHandle, TransferStats, TransportKind
from cleave.transfer import framing
from cleave.transfer.layer_frames import LayerLedger, header_layers
from cleave.transfer.layout import check_layout
from cleave.transfer.tensors import (
    as_bytes,
    device_index,
    check_kv_cache,
    dtype_name,
    from_bytes,
    layer_chunk_shape,
    scatter_layer,
)

if TYPE_CHECKING:
    from cleave.transfer.nccl import NcclCommunicator


@dataclass
class _Transfer:
    """Receiver-side state of one expected transfer."""

    transfer_id: str
    block_ids: tuple[int, ...]  # destination blocks that receive data (cached ones skipped)
    transport: TransportKind
    nccl: NcclCommunicator | None
    future: asyncio.Future
    started: float
    layers: LayerLedger
    index: torch.Tensor | None = None  # [n] int64 on the cache device, built on first scatter
    num_bytes: int = 0
    writers: list[asyncio.StreamWriter] = field(default_factory=list)
    timer: asyncio.TimerHandle | None = None


class PendingTransfer:
    """A registered transfer: its handle for the sender, and completion for the receiver."""

    def __init__(self, receiver: KVReceiver, state: _Transfer, handle: TransferHandle) -> None:
        self._receiver = receiver
        self._state = state
        self.handle = handle

    @property
    def transfer_id(self) -> str:
        return self._state.transfer_id

    @property
    def done(self) -> bool:
        return self._state.future.done()

    async def wait(self) -> TransferStats:
        """Stats once every layer arrived; raises DeadlineExceeded (or the chunk's error)."""
        return await asyncio.shield(self._state.future)

    def cancel(self, reason: str = "cancelled by the receiver") -> None:
        """Drop the registration; later chunks are rejected."""
        self._receiver._fail(self._state, NotFound(reason))


class KVReceiver:
    """Bulk KV endpoint of a worker: receives transfers into its KV cache.

    kv_cache: [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim], CPU or CUDA.
    """

    def __init__(
        self,
        kv_cache: torch.Tensor,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        advertise_host: str | None = None,
        layout: KVLayout | None = None,
    ) -> None:
        check_kv_cache(kv_cache)
        if layout is not None:
            check_layout(layout, kv_cache)
        self.kv_cache = kv_cache
        self.layout = layout
        self._host, self._port = host, port
        self._advertise_host = advertise_host or (socket.gethostname() if host in ("0.0.0.0", "::") else host)
        self._transfers: dict[str, _Transfer] = {}
        self._server: asyncio.base_events.Server | None = None
        self._connections: dict[asyncio.Task, asyncio.StreamWriter] = {}
        self._ipc_handle: bytes | None = None

    @property
    def num_layers(self) -> int:
        return self.kv_cache.shape[0]

    @property
    def address(self) -> str:
        """host:port senders connect to (valid after start())."""
        if self._server is None:
            raise FailedPrecondition("KVReceiver.start() has not been called")
        return f"{self._advertise_host}:{self._server.sockets[0].getsockname()[1]}"

    async def start(self) -> None:
        """Listen for senders."""
        self._server = await asyncio.start_server(self._on_connection, self._host, self._port)

    async def close(self) -> None:
        """Stop listening, fail every pending transfer, close connections."""
        for state in list(self._transfers.values()):
            self._fail(state, FailedPrecondition("the receiver is shutting down"))
        if self._server is not None:
            self._server.close()  # stop accepting
        # Closing the sockets ends each connection's read loop (cancelling its task instead
        # makes asyncio log the cancellation as an error). Senders keep their connections
        # open, and from Python 3.12 `wait_closed` waits for every connection to end, so
        # they are closed first.
        for writer in self._connections.values():
            writer.close()
        await asyncio.gather(*self._connections, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()

    def export_cuda_ipc(self) -> bytes:
        """This cache's CUDA IPC handle (exported once), for TransferHandle.cuda_ipc_handle."""
        if self._ipc_handle is None:
            from cleave.transfer.cuda_ipc import export_tensor

            self._ipc_handle = export_tensor(self.kv_cache).to_bytes()
        return self._ipc_handle

    def expect(
        self,
        transfer_id: str,
        block_ids: Sequence[int],
        *,
        num_cached_blocks: int = 0,
        timeout_s: float | None = None,
        deadline_unix_s: float | None = None,
        transport: TransportKind = TransportKind.TCP,
        nccl: NcclCommunicator | None = None,
        worker_id: str = "",
        control_address: str = "",
    ) -> PendingTransfer:
        """Register a transfer into `block_ids` (prompt order; the first num_cached_blocks
        are already filled and receive nothing). It fails with DeadlineExceeded after
        `timeout_s` seconds or at `deadline_unix_s`, whichever is first. `worker_id` and
        `control_address` (the worker's gRPC endpoint) travel in the handle, so a sender
        can handshake with this worker."""
        if not transfer_id:
            raise InvalidArgument("must be set", field="transfer_id")
        if transfer_id in self._transfers:
            raise InvalidArgument(f"transfer {transfer_id!r} is already registered", field="transfer_id")
        if not 0 <= num_cached_blocks <= len(block_ids):
            raise InvalidArgument("must be within [0, len(block_ids)]", field="num_cached_blocks")
        num_blocks = self.kv_cache.shape[2]
        for position, block_id in enumerate(block_ids):
            if not 0 <= block_id < num_blocks:
                raise InvalidArgument(f"block id {block_id} outside [0, {num_blocks})", field=f"block_ids[{position}]")
        if transport is TransportKind.NCCL and nccl is None:
            raise InvalidArgument("NCCL transfers need the peer's communicator", field="nccl")
        loop = asyncio.get_running_loop()
        moved = tuple(block_ids[num_cached_blocks:])
        state = _Transfer(
            transfer_id=transfer_id,
            block_ids=moved,
            transport=transport,
            nccl=nccl,
            future=loop.create_future(),
            started=time.perf_counter(),
            layers=LayerLedger(self.num_layers),
        )
        state.future.add_done_callback(lambda f: f.exception() if not f.cancelled() else None)
        delays = [t for t in (timeout_s, None if deadline_unix_s is None else deadline_unix_s - time.time()) if t is not None]
        if delays:
            state.timer = loop.call_later(max(0.0, min(delays)), self._expire, state)
        self._transfers[transfer_id] = state
        handle = TransferHandle(
            transport=transport,
            address=self.address,
            transfer_id=transfer_id,
            block_ids=tuple(block_ids),
            layout=self.layout,
            nccl_unique_id=nccl.unique_id if nccl is not None else b"",
            cuda_ipc_handle=self.export_cuda_ipc() if transport is TransportKind.CUDA_IPC else b"",
            device_index=self.kv_cache.device.index if self.kv_cache.is_cuda else None,
            deadline_unix_s=deadline_unix_s if deadline_unix_s is not None else (
                None if timeout_s is None else time.time() + timeout_s),
            num_cached_blocks=num_cached_blocks,
            worker_id=worker_id,
            control_address=control_address,
        )
        return PendingTransfer(self, state, handle)

    # -- completion -------------------------------------------------------------------------

    def _expire(self, state: _Transfer) -> None:
        missing = state.layers.num_missing
        self._fail(state, DeadlineExceeded(
            f"transfer {state.transfer_id!r} did not complete in time ({missing} of "
            f"{self.num_layers} layers missing); its blocks must be freed"))

    def _finish(self, state: _Transfer, error: CleaveError | None) -> None:
        if self._transfers.get(state.transfer_id) is state:
            del self._transfers[state.transfer_id]
        if state.timer is not None:
            state.timer.cancel()
        if state.future.done():
            return
        if error is None:
            state.future.set_result(TransferStats(
                transport=state.transport, num_bytes=state.num_bytes,
                seconds=time.perf_counter() - state.started, num_blocks=len(state.block_ids)))
        else:
            state.future.set_exception(error)
        frame = framing.encode_frame(_reply(state.transfer_id, error))
        for writer in state.writers:
            if not writer.is_closing():
                writer.write(frame)

    def _fail(self, state: _Transfer, error: CleaveError) -> None:
        self._finish(state, error)

    # -- connections ------------------------------------------------------------------------

    async def _on_connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        self._connections[task] = writer
        try:
            while True:
                try:
                    header = await framing.read_header(reader)
                except (asyncio.IncompleteReadError, ConnectionError):
                    return
                except InvalidArgument as error:  # corrupt frame: the stream is lost
                    writer.write(framing.encode_frame(common_pb2.ErrorDetail(
                        code=common_pb2.ERROR_CODE_INVALID_ARGUMENT, message=str(error))))
                    await writer.drain()
                    return
                state = self._transfers.get(header.transfer_id)
                try:
                    if state is None:
                        raise NotFound(
                            f"unknown transfer id {header.transfer_id!r} "
                            "(expired, finished or never registered)")
                    if writer not in state.writers:
                        state.writers.append(writer)
                    await self._receive_chunk(state, header, reader)
                except CleaveError as error:
                    # Refuse this transfer, skip its chunk's bytes and keep serving the
                    # other transfers that share the connection.
                    if state is not None:
                        self._fail(state, error)
                    else:
                        writer.write(framing.encode_frame(_reply(header.transfer_id, error)))
                    await framing.skip_payload(reader, header.byte_length)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            return
        finally:
            self._connections.pop(task, None)
            writer.close()

    def _check_chunk(self, state: _Transfer, header: common_pb2.KVChunkHeader) -> tuple[range, tuple[int, ...]]:
        cache = self.kv_cache
        layers = header_layers(header)
        state.layers.check(layers, field="layer_index")
        first_chunk = state.layers.num_done == 0  # it must name the block ids; later ones may not
        if (header.block_ids or first_chunk) and tuple(header.block_ids) != state.block_ids:
            raise InvalidArgument("block ids differ from the reserved ones", field="block_ids")
        if header.dtype != dtype_to_proto(dtype_name(cache.dtype)):
            raise InvalidArgument(
                f"dtype {common_pb2.DType.Name(header.dtype)} differs from the cache's {dtype_name(cache.dtype)}",
                field="dtype")
        shape = layer_chunk_shape(cache, len(state.block_ids), len(layers))
        if tuple(header.shape) != shape:
            raise InvalidArgument(f"shape {list(header.shape)} differs from the expected {list(shape)}", field="shape")
        inline = state.transport is TransportKind.TCP
        expected_bytes = cache.element_size() * torch.Size(shape).numel() if inline else 0
        if header.byte_length != expected_bytes:
            raise InvalidArgument(f"byte_length {header.byte_length} != {expected_bytes}", field="byte_length")
        if header.is_last and not state.layers.completes(layers):
            raise InvalidArgument("is_last set before every layer was sent", field="is_last")
        return layers, shape

    def _index(self, state: _Transfer) -> torch.Tensor:
        if state.index is None:  # on the stream the scatter runs on (the caller's current one)
            state.index = device_index(state.block_ids, self.kv_cache.device)
        return state.index

    async def _receive_chunk(
        self, state: _Transfer, header: common_pb2.KVChunkHeader, reader: asyncio.StreamReader
    ) -> None:
        layers, shape = self._check_chunk(state, header)
        cache = self.kv_cache
        chunk_bytes = cache.element_size() * torch.Size(shape).numel()
        if state.transport is TransportKind.TCP:
            staging = torch.empty(header.byte_length, dtype=torch.uint8, pin_memory=cache.is_cuda)
            await framing.read_payload(reader, as_bytes(staging))
            chunk = from_bytes(staging, cache.dtype, shape)  # [2, n, BS, Hkv, D] or [k, 2, n, BS, Hkv, D]
            await _on_device(cache, lambda: _scatter(cache, layers, self._index(state), chunk.to(
                cache.device, non_blocking=True)))
        elif state.transport is TransportKind.NCCL:
            assert state.nccl is not None
            comm = state.nccl

            def receive() -> None:
                buffer = torch.empty(shape, dtype=cache.dtype, device=cache.device)
                comm.recv(buffer, peer=0)
                _scatter(cache, layers, self._index(state), buffer)

            await _on_device(cache, receive, stream=comm.stream)
        state.layers.add(layers, field="layer_index")
        state.num_bytes += chunk_bytes
        if state.layers.is_complete:
            self._finish(state, None)


def _scatter(cache: torch.Tensor, layers: range, index: torch.Tensor, chunk: torch.Tensor) -> None:
    """chunk: [2, n, BS, Hkv, D] for one layer, [len(layers), 2, n, BS, Hkv, D] for a run."""
    if len(layers) == 1:
        scatter_layer(cache, layers.start, index, chunk)
        return
    for position, layer in enumerate(layers):
        scatter_layer(cache, layer, index, chunk[position])


def _reply(transfer_id: str, error: CleaveError | None) -> common_pb2.ErrorDetail:
    """The result frame of a transfer: code UNSPECIFIED on success."""
    reply = common_pb2.ErrorDetail(request_id=transfer_id)
    if error is not None:
        reply.code = error_code_for(getattr(grpc.StatusCode, error.status_code, grpc.StatusCode.UNKNOWN))
        reply.message = str(error)
    return reply


async def _on_device(cache: torch.Tensor, work, stream=None) -> None:
    """Run `work` (enqueues device work); on CUDA wait for it off the event loop."""
    if not cache.is_cuda:
        work()
        return
    stream = stream or torch.cuda.current_stream(cache.device)
    with torch.cuda.stream(stream):
        work()
        event = torch.cuda.Event()
        event.record(stream)
    await asyncio.to_thread(event.synchronize)
