"""The prefill workers that handshook with this decode worker, and the transport each uses.

A Handshake compares KV layouts, picks the transport both ends support (`choose_transport`:
CUDA IPC on one host, NCCL across hosts when both offer it, else TCP) and, for NCCL, starts
joining the two-rank communicator (rank 1 here; the prefill worker joins as rank 0 after the
reply). Admissions from that prefill worker then expect their KV over that transport.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import torch

from cleave.errors import CleaveError, Unavailable
from cleave.rpc.types import KVLayout, TransportKind
from cleave.transfer import KVReceiver, choose_transport, local_endpoint, peer_endpoint
from cleave.transfer.layout import head_slice
from services.decode.backend import HandshakeResult, HandshakeSpec


@dataclass
class Peer:
    """A prefill worker that handshook: the transport its transfers use."""

    transport: TransportKind
    nccl: asyncio.Task | None = None  # joins the two-rank communicator


class PeerLinks:
    """Transport state per prefill worker id.

    Args:
        worker_id: this decode worker's id, echoed in handshake results.
    """

    def __init__(self, worker_id: str) -> None:
        self.worker_id = worker_id
        self._peers: dict[str, Peer] = {}

    async def handshake(
        self, spec: HandshakeSpec, device: torch.device, receiver: KVReceiver, layout: KVLayout
    ) -> HandshakeResult:
        """Agree on a transport with the prefill worker `spec.peer_id` (`device`: the KV cache's)."""
        if spec.layout is not None:
            head_slice(spec.layout, layout, "layout")  # refuses what cannot be mapped
        local = local_endpoint(device, nccl_available=bool(spec.nccl_unique_id))
        transport = choose_transport(peer_endpoint(spec.host, spec.gpu_uuids, spec.supported_transports, local), local)
        nccl_task = None
        if transport is TransportKind.NCCL:
            from cleave.transfer.nccl import NcclCommunicator

            # Returns once the prefill worker joins as rank 0 (after this reply).
            nccl_task = asyncio.ensure_future(NcclCommunicator.create(spec.nccl_unique_id, rank=1, device=device))
        self._peers[spec.peer_id] = Peer(transport, nccl_task)
        return HandshakeResult(
            transport=transport, worker_id=self.worker_id, layout=layout, rank=1, world_size=2,
            tcp_address=receiver.address,
        )

    async def transport_for(self, prefill_worker_id: str, timeout_s: float):  # -> (TransportKind, NcclCommunicator | None)
        """The transport (and NCCL communicator, once joined) for KV from `prefill_worker_id`;
        TCP for a worker that never handshook."""
        peer = self._peers.get(prefill_worker_id)
        if peer is None:
            return TransportKind.TCP, None
        if peer.nccl is None:
            return peer.transport, None
        try:
            return peer.transport, await asyncio.wait_for(asyncio.shield(peer.nccl), timeout_s)
        except (asyncio.TimeoutError, CleaveError, OSError) as error:
            raise Unavailable(f"NCCL link with {prefill_worker_id!r} is not up: {error}; handshake again") from None

    def close(self) -> None:
        """Close the NCCL communicators that were joined."""
        for peer in self._peers.values():
            if peer.nccl is not None and peer.nccl.done() and not peer.nccl.exception():
                peer.nccl.result().close()
