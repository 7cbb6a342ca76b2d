"""Sending side of a worker: `KVTransferClient.open(handle)` -> the handle's transport's sender.

A prefill worker keeps one `KVTransferClient` (bulk connections by receiver address, opened
CUDA IPC caches, NCCL communicators by peer, one copy stream per device) and opens one sender
per request. `open` picks the class from the handle's transport — `CudaIpcKVSender`,
`NcclKVSender` or `TcpKVSender`, each a `BaseKVSender` (`cleave.transfer.base`: the contract,
`send_layers` / `send_layer` / `send_all` / `finish` / `close`). Calling `send_layers` right
after a layer's forward overlaps the transfer with the next layers; `finish` flushes the
frames and waits, once, for the receiver's verdict.
"""

from __future__ import annotations

import asyncio

import structlog
import torch

from cleave.errors import FailedPrecondition, InvalidArgument
from cleave.rpc.types import TransferHandle, TransportKind
from cleave.tls import TlsConfig
from cleave.transfer.base import BaseKVSender
from cleave.transfer.connection import BulkConnection
from cleave.transfer.cuda_ipc import CudaIpcKVSender, IpcCacheMap
from cleave.transfer.nccl import NcclCommunicator, NcclKVSender
from cleave.transfer.tcp import TcpKVSender

log = structlog.get_logger(__name__)

# The type `KVTransferClient.open` returns, under the name callers have used.
KVSender = BaseKVSender


class KVTransferClient:
    """A worker's sending side: bulk connections, mapped CUDA IPC caches, NCCL peers."""

    def __init__(self, internal_token: str | None = None, *, tls: TlsConfig | None = None) -> None:
        self._internal_token = internal_token  # every bulk connection opens with it
        self._tls = tls  # bulk connections go over TLS with it
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

    def add_nccl_peer(self, address: str, comm: NcclCommunicator) -> None:
        """Use `comm` for NCCL transfers to the receiver whose bulk endpoint is `address`."""
        self._nccl[address] = comm

    def nccl_peer(self, address: str) -> NcclCommunicator:
        """The communicator registered for `address` (FailedPrecondition before the handshake)."""
        if address not in self._nccl:
            raise FailedPrecondition(f"no NCCL communicator with {address}; handshake first")
        return self._nccl[address]

    async def _connection(self, address: str) -> BulkConnection:
        lock = self._connecting.setdefault(address, asyncio.Lock())
        async with lock:
            connection = self._connections.get(address)
            if connection is None or connection.is_closed:
                connection = self._connections[address] = await BulkConnection.open(
                    address, internal_token=self._internal_token, tls=self._tls)
                connection.on_closed(lambda: self._receiver_gone(address))
            return connection

    def _receiver_gone(self, address: str) -> None:
        """A receiver's connection closed: let go of its mapped CUDA IPC cache (else a dead
        decode worker's cache stays allocated on the GPU, `IpcCacheMap`), after the copies
        in flight (into it, among others) finished."""
        if address not in self.ipc_caches.peers():
            return
        for stream in self._copy_streams.values():
            stream.synchronize()
        forgotten = self.ipc_caches.forget_peer(address)
        log.info("released a KV receiver's mapped cache", receiver=address, num_caches=forgotten)

    async def open(self, handle: TransferHandle) -> BaseKVSender:
        """A sender for one transfer, of the handle's transport (connects to the receiver on
        first use)."""
        if not handle.address:
            raise InvalidArgument("the transfer handle names no receiver address", field="address")
        if handle.transport is TransportKind.CUDA_IPC:
            if not handle.cuda_ipc_handle:
                raise InvalidArgument("CUDA IPC transfers need the receiver's handle", field="cuda_ipc_handle")
            connection = await self._connection(handle.address)
            return CudaIpcKVSender(handle, connection, self.ipc_caches, self.copy_stream)
        if handle.transport is TransportKind.NCCL:
            comm = self.nccl_peer(handle.address)
            return NcclKVSender(handle, await self._connection(handle.address), comm)
        return TcpKVSender(handle, await self._connection(handle.address))

    async def close(self) -> None:
        for connection in self._connections.values():
            await connection.close()
        self._connections.clear()
        self.ipc_caches.clear()
