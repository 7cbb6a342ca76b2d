"""A prefill worker's transport negotiation with decode workers: one Handshake per pair.

The decode worker's Admit returns a TransferHandle naming the worker (`worker_id`) and its
gRPC endpoint (`control_address`). Before the first transfer to a decode worker the prefill
worker calls that endpoint's `Decode.Handshake` with its own endpoint (host, GPU UUID,
transports, an NCCL unique id when it can run NCCL) and keeps the answer, a `PeerLink`, for
the pair. The decode worker remembers it under the prefill worker's id and from then on its
Admit hands out handles of the negotiated kind:

    CUDA_IPC  both on one GPU: nothing to set up here; each handle carries the decode
              worker's exported cache, which KVTransferClient.ipc_caches opens once.
    NCCL      different GPUs: join the two-rank communicator as rank 0 (the decode worker
              joins as rank 1 while answering) and register it with add_nccl_peer.
    TCP       anything else.

Handles issued before the handshake finished say TCP and still go over TCP. A handshake that
fails leaves the pair on TCP; it is tried again after `retry_after_s`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol

import grpc
import structlog
import torch

from cleave.errors import CleaveError, FailedPrecondition
from cleave.proto.cleave.v1 import decode_pb2, decode_pb2_grpc
from cleave.rpc.client import aio_channel, tls_credentials
from cleave.rpc.convert import kv_layout_from_proto, kv_layout_to_proto, transport_from_proto, transport_to_proto
from cleave.rpc.types import KVLayout, TransferHandle, TransportKind
from cleave.tls import TlsConfig
from cleave.transfer import EndpointInfo, KVTransferClient
from cleave.transfer.choose import proposed_transports
from cleave.transfer.layout import head_slice
from cleave.transfer.nccl import NcclCommunicator, NcclLibrary

log = structlog.get_logger("cleave.handshake")

HandshakeCall = Callable[[str, decode_pb2.HandshakeRequest], Awaitable[decode_pb2.HandshakeResponse]]


@dataclass(frozen=True)
class PeerLink:
    """What a prefill worker negotiated with one decode worker."""

    worker_id: str
    control_address: str
    transport: TransportKind
    bulk_address: str  # the decode worker's KV endpoint (TransferHandle.address)


class NcclRendezvous(Protocol):
    """Rank 0's side of a two-rank NCCL communicator: make its id, then join it."""

    def unique_id(self) -> bytes: ...

    async def connect(self, unique_id: bytes) -> NcclCommunicator: ...


class DeviceNccl:
    """NCCL on this process's KV-cache device, through the libnccl torch ships."""

    def __init__(self, device: torch.device, library: NcclLibrary | None = None) -> None:
        self.device = device
        self.library = library or NcclLibrary()

    def unique_id(self) -> bytes:
        return self.library.unique_id()

    async def connect(self, unique_id: bytes) -> NcclCommunicator:
        return await NcclCommunicator.create(unique_id, rank=0, device=self.device, library=self.library)


def device_nccl(device: torch.device | str) -> DeviceNccl | None:
    """NCCL on `device`, or None on CPU or where libnccl cannot be loaded."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    try:
        return DeviceNccl(device)
    except CleaveError as error:
        log.info("NCCL is not available; KV transfers to other GPUs use TCP", error=str(error))
        return None


def grpc_handshake(timeout_s: float, internal_token: str | None = None, *,
                   tls: TlsConfig | None = None) -> HandshakeCall:
    """Calls Decode.Handshake at an address over a channel opened for that one call (sending
    the internal token when there is one; over TLS with `tls`)."""

    async def call(address: str, request: decode_pb2.HandshakeRequest) -> decode_pb2.HandshakeResponse:
        channel = aio_channel(address, internal_token=internal_token, credentials=tls_credentials(tls))
        try:
            return await decode_pb2_grpc.DecodeStub(channel).Handshake(request, timeout=timeout_s)
        finally:
            await channel.close()

    return call


@dataclass
class _Attempt:
    task: asyncio.Task  # -> PeerLink, or None when the handshake failed
    started: float


class TransportNegotiator:
    """Negotiates, once per decode worker, the transport a prefill worker's transfers use.

    Args:
        worker_id: this prefill worker's id (the decode worker keys the result by it; the
            gateway's AdmitRequest.prefill_worker_id names the same id).
        endpoint: where this worker's KV cache lives (`cleave.transfer.local_endpoint`).
        layout: this worker's KV layout; a decode worker with another layout is refused.
        transfers: the worker's sending side; NCCL communicators are registered on it.
        nccl: how to join an NCCL communicator (needed when `endpoint` lists NCCL).
        call: sends a HandshakeRequest to a decode worker (default: gRPC).
        retry_after_s: a failed handshake is tried again after this long.
    """

    def __init__(
        self,
        worker_id: str,
        endpoint: EndpointInfo,
        layout: KVLayout | None,
        transfers: KVTransferClient,
        *,
        nccl: NcclRendezvous | None = None,
        call: HandshakeCall | None = None,
        timeout_s: float = 30.0,
        retry_after_s: float = 30.0,
    ) -> None:
        if TransportKind.NCCL in endpoint.transports and nccl is None:
            raise FailedPrecondition("an endpoint that proposes NCCL needs an NcclRendezvous")
        self.worker_id = worker_id
        self.endpoint = endpoint
        self.layout = layout
        self.transfers = transfers
        self.retry_after_s = retry_after_s
        self._nccl = nccl
        self._call = call or grpc_handshake(timeout_s)
        self._attempts: dict[tuple[str, str], _Attempt] = {}
        self._communicators: list[NcclCommunicator] = []
        self.num_handshakes = 0
        self.num_handshake_failures = 0

    def link(self, handle: TransferHandle) -> PeerLink | None:
        """The negotiated link with the handle's decode worker, if there is one yet."""
        attempt = self._attempts.get(_peer_key(handle))
        if attempt is None or not attempt.task.done() or attempt.task.cancelled():
            return None
        return attempt.task.result()

    async def prepare(self, handle: TransferHandle) -> PeerLink | None:
        """Make sure the pair negotiated before a transfer over `handle`: handshake on first
        contact (concurrent callers share it), else the kept result. None when the handle
        names no control endpoint or the handshake failed (the handle's transport is used)."""
        if not handle.control_address:
            return None
        key = _peer_key(handle)
        attempt = self._attempts.get(key)
        if attempt is None or self._may_retry(attempt):
            attempt = self._attempts[key] = _Attempt(
                asyncio.ensure_future(self._handshake_or_none(handle)), time.monotonic())
        return await asyncio.shield(attempt.task)

    def _may_retry(self, attempt: _Attempt) -> bool:
        task = attempt.task
        failed = task.done() and (task.cancelled() or task.result() is None)
        return failed and time.monotonic() - attempt.started >= self.retry_after_s

    async def _handshake_or_none(self, handle: TransferHandle) -> PeerLink | None:
        try:
            return await self._handshake(handle)
        except (CleaveError, grpc.aio.AioRpcError, OSError) as error:
            self.num_handshake_failures += 1
            log.warning("transport handshake failed; transfers to this decode worker stay on their "
                        "handles' transport", decode_worker=handle.worker_id, address=handle.control_address,
                        retry_after_s=self.retry_after_s, error=_describe(error))
            return None

    def request(self, nccl_unique_id: bytes = b"") -> decode_pb2.HandshakeRequest:
        """This worker's proposal."""
        endpoint = self.endpoint
        request = decode_pb2.HandshakeRequest(
            peer_id=self.worker_id,
            supported_transports=[transport_to_proto(kind) for kind in proposed_transports(endpoint)],
            host=endpoint.host,
            gpu_uuids=[endpoint.gpu_uuid] if endpoint.has_gpu else [],
            nccl_unique_id=nccl_unique_id,
        )
        if self.layout is not None:
            request.layout.CopyFrom(kv_layout_to_proto(self.layout))
        return request

    async def _handshake(self, handle: TransferHandle) -> PeerLink:
        proposes_nccl = TransportKind.NCCL in self.endpoint.transports
        unique_id = self._nccl.unique_id() if proposes_nccl and self._nccl is not None else b""
        self.num_handshakes += 1
        response = await self._call(handle.control_address, self.request(unique_id))
        transport = transport_from_proto(response.transport, "transport")
        if transport not in self.endpoint.transports:
            raise FailedPrecondition(f"the decode worker chose {transport.value}, which this worker did not offer")
        if self.layout is not None and response.HasField("layout"):
            head_slice(self.layout, kv_layout_from_proto(response.layout), "layout")  # refuses what cannot be mapped
        bulk_address = response.tcp_address or handle.address
        if transport is TransportKind.NCCL:
            assert self._nccl is not None
            # The decode worker joined as rank 1 before answering; this returns once both did.
            communicator = await self._nccl.connect(unique_id)
            self._communicators.append(communicator)
            self.transfers.add_nccl_peer(bulk_address, communicator)
        link = PeerLink(worker_id=response.worker_id or handle.worker_id, control_address=handle.control_address,
                        transport=transport, bulk_address=bulk_address)
        log.info("transport negotiated", decode_worker=link.worker_id, transport=transport.value)
        return link

    async def close(self) -> None:
        """Stop pending handshakes and destroy the NCCL communicators."""
        for attempt in self._attempts.values():
            attempt.task.cancel()
        await asyncio.gather(*(a.task for a in self._attempts.values()), return_exceptions=True)
        self._attempts.clear()
        for communicator in self._communicators:
            communicator.close()
        self._communicators.clear()


def _peer_key(handle: TransferHandle) -> tuple[str, str]:
    return handle.worker_id, handle.control_address


def _describe(error: BaseException) -> str:
    if isinstance(error, grpc.aio.AioRpcError):
        return f"{error.code().name}: {error.details()}"
    return str(error)
