"""Receiving side of a worker: `KVReceiver`, a bulk endpoint (asyncio TCP server) over its cache.

The decode worker builds one `KVReceiver` over its KV cache, registers every admitted
request with `expect()` (the reserved block ids, a deadline) and hands the returned
`PendingTransfer.handle` to the sender. Each expected transfer gets a receiving end of its
transport (`cleave.transfer.base.BaseKVReceiver`): `TcpKVReceiver` (the chunk's bytes follow
its header and are scattered into the reserved blocks), `CudaIpcKVReceiver` (the sender
already wrote the blocks through the exported cache handle; the header only says which layers
landed) or `NcclKVReceiver` (the header announces the chunk, its bytes arrive over the peer's
communicator). Chunks arrive per layer or per run of layers (`KVChunkHeader.num_layers`;
framing in `cleave.transfer.framing`); this endpoint only routes each header to its end.
Registering a transfer touches no device (the block index is built on first use, by the
transports that scatter), so Admit never waits for the decode engine's step.
A transfer completes once every layer arrived; then the sender gets a result frame and
`PendingTransfer.wait()` returns. A transfer that is not complete by its deadline fails with
`DeadlineExceeded` (the caller frees its blocks) and later chunks for it are rejected.
With an internal token, a connection must open with it (`framing.read_hello`) or is closed
before any chunk is read: transfer ids are guessable, the token is not.
"""

from __future__ import annotations

import asyncio
import hmac
import socket
import time
from collections.abc import Sequence

import structlog
import torch

from cleave.errors import CleaveError, FailedPrecondition, InvalidArgument, NotFound, Unauthenticated
from cleave.proto.cleave.v1 import common_pb2
from cleave.rpc.types import KVLayout, TransferHandle, TransferStats, TransportKind
from cleave.tls import TlsConfig
from cleave.transfer import framing
from cleave.transfer.base import BaseKVReceiver
from cleave.transfer.cuda_ipc import CudaIpcKVReceiver, export_tensor
from cleave.transfer.layout import check_layout
from cleave.transfer.nccl import NcclCommunicator, NcclKVReceiver
from cleave.transfer.tcp import TcpKVReceiver
from cleave.transfer.tensors import check_kv_cache

HELLO_TIMEOUT_S = 10.0  # a connection that sends no token in this time is closed
log = structlog.get_logger("cleave.transfer")


class PendingTransfer:
    """A registered transfer: its handle for the sender, and completion for the receiver."""

    def __init__(self, end: BaseKVReceiver, handle: TransferHandle) -> None:
        self._end = end
        self.handle = handle

    @property
    def transfer_id(self) -> str:
        return self._end.transfer_id

    @property
    def done(self) -> bool:
        return self._end.is_settled

    async def registered(self) -> TransferHandle:
        """The handle to give the sender, once every receiving end expects the transfer:
        at once here (a tensor-parallel worker's `RankedTransfer` waits for its ranks)."""
        return self.handle

    async def wait(self) -> TransferStats:
        """Stats once every layer arrived; raises DeadlineExceeded (or the chunk's error)."""
        return await asyncio.shield(self._end.future)

    def cancel(self, reason: str = "cancelled by the receiver") -> None:
        """Drop the registration; later chunks are rejected."""
        self._end.fail(NotFound(reason))


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
        internal_token: str | None = None,
        tls: TlsConfig | None = None,
    ) -> None:
        check_kv_cache(kv_cache)
        self._internal_token = None if internal_token is None else internal_token.encode()
        self._tls = tls  # senders connect over TLS, presenting a certificate its CA signed
        if layout is not None:
            check_layout(layout, kv_cache)
        self.kv_cache = kv_cache
        self.layout = layout
        self._host, self._port = host, port
        self._advertise_host = advertise_host or (socket.gethostname() if host in ("0.0.0.0", "::") else host)
        self._transfers: dict[str, BaseKVReceiver] = {}
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
        ssl = None if self._tls is None else self._tls.server_context(mutual=True)
        self._server = await asyncio.start_server(self._on_connection, self._host, self._port, ssl=ssl)

    async def close(self) -> None:
        """Stop listening, fail every pending transfer, close connections."""
        for end in list(self._transfers.values()):
            end.fail(FailedPrecondition("the receiver is shutting down"))
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
        end = self._receiving_end(transport, transfer_id, block_ids[num_cached_blocks:], nccl)
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
        delays = [t for t in (timeout_s, None if deadline_unix_s is None else deadline_unix_s - time.time()) if t is not None]
        if delays:
            end.expire_after(min(delays))
        self._transfers[transfer_id] = end
        return PendingTransfer(end, handle)

    def _receiving_end(self, transport: TransportKind, transfer_id: str, block_ids: Sequence[int],
                       nccl: NcclCommunicator | None) -> BaseKVReceiver:
        """The receiving end of one transfer over `transport`."""
        if transport is TransportKind.NCCL:
            return NcclKVReceiver(self.kv_cache, transfer_id, block_ids, comm=nccl, transport=transport,
                                  on_settled=self._forget)
        end_type = CudaIpcKVReceiver if transport is TransportKind.CUDA_IPC else TcpKVReceiver
        return end_type(self.kv_cache, transfer_id, block_ids, transport=transport, on_settled=self._forget)

    def _forget(self, end: BaseKVReceiver) -> None:
        """Drop a settled transfer: later chunks for its id are refused as unknown."""
        if self._transfers.get(end.transfer_id) is end:
            del self._transfers[end.transfer_id]

    # -- connections ------------------------------------------------------------------------

    async def _authenticated(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        """Whether the connection opened with the internal token (always, without one); a
        refused sender gets an error frame naming why, then the connection closes."""
        if self._internal_token is None:
            return True
        try:
            token = await asyncio.wait_for(framing.read_hello(reader), HELLO_TIMEOUT_S)
            if not hmac.compare_digest(token, self._internal_token):
                raise Unauthenticated("the bulk KV connection's internal token is wrong; start the sender "
                                      "with the same CLEAVE_INTERNAL_TOKEN as this receiver")
        except (Unauthenticated, asyncio.TimeoutError) as error:
            reason = str(error) or f"no internal token in {HELLO_TIMEOUT_S:g} s"
            log.warning("refused a bulk KV connection", peer=str(writer.get_extra_info("peername")), reason=reason)
            writer.write(framing.encode_frame(framing.verdict("", Unauthenticated(reason))))
            await writer.drain()
            return False
        return True

    async def _on_connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        self._connections[task] = writer
        try:
            if not await self._authenticated(reader, writer):
                return
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
                end = self._transfers.get(header.transfer_id)
                try:
                    if end is None:
                        raise NotFound(
                            f"unknown transfer id {header.transfer_id!r} "
                            "(expired, finished or never registered)")
                    if writer not in end.writers:
                        end.writers.append(writer)
                    await end.accept(header, reader)
                except CleaveError as error:
                    # The end failed its transfer (and told the sender); an unknown id is
                    # answered here. Skip the chunk's bytes and keep serving the other
                    # transfers that share the connection.
                    if end is None:
                        writer.write(framing.encode_frame(framing.verdict(header.transfer_id, error)))
                    await framing.skip_payload(reader, header.byte_length)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            return
        finally:
            self._connections.pop(task, None)
            writer.close()
