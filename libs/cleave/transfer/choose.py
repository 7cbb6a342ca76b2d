"""Which bulk transport two workers use, from where their ends live."""

from __future__ import annotations

import socket
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from cleave.rpc.types import TransportKind


@dataclass(frozen=True)
class EndpointInfo:
    """Where one end of a transfer lives and which transports it can run."""

    host: str  # hostname or node id; equal hosts share memory and PCIe/NVLink
    device_kind: str  # "cuda" or "cpu"
    device_index: int | None = None
    gpu_uuid: str = ""
    transports: frozenset[TransportKind] = frozenset({TransportKind.TCP})

    @property
    def has_gpu(self) -> bool:
        return self.device_kind == "cuda" and bool(self.gpu_uuid)


# Most preferred first: a shared GPU beats a GPU link, which beats the host network.
TRANSPORT_PREFERENCE = (TransportKind.CUDA_IPC, TransportKind.NCCL, TransportKind.TCP)


def proposed_transports(endpoint: EndpointInfo) -> tuple[TransportKind, ...]:
    """`endpoint`'s transports, most preferred first (HandshakeRequest.supported_transports)."""
    return tuple(kind for kind in TRANSPORT_PREFERENCE if kind in endpoint.transports)


def peer_endpoint(host: str, gpu_uuids: Sequence[str], transports: Iterable[TransportKind],
                  local: EndpointInfo) -> EndpointInfo:
    """The endpoint a handshake describes, as `local` sees it: of the peer's GPUs, the one
    `local` runs on when they share one (so `choose_transport` picks CUDA IPC), else its first."""
    uuid = local.gpu_uuid if local.gpu_uuid and local.gpu_uuid in gpu_uuids else next(iter(gpu_uuids), "")
    return EndpointInfo(host=host, device_kind="cuda" if uuid else "cpu", gpu_uuid=uuid,
                        transports=frozenset(transports))


def choose_transport(sender: EndpointInfo, receiver: EndpointInfo) -> TransportKind:
    """CUDA IPC on one GPU of one host; NCCL between GPUs when both run it; TCP otherwise."""
    both = sender.transports & receiver.transports
    if sender.has_gpu and receiver.has_gpu:
        if sender.host == receiver.host and sender.gpu_uuid == receiver.gpu_uuid:
            # NCCL refuses two ranks on one device, so a shared GPU is IPC or nothing.
            if TransportKind.CUDA_IPC in both:
                return TransportKind.CUDA_IPC
        elif TransportKind.NCCL in both:
            return TransportKind.NCCL
    return TransportKind.TCP


def local_endpoint(device: torch.device | str, nccl_available: bool, host: str | None = None) -> EndpointInfo:
    """This process's endpoint for a KV cache on `device`."""
    device = torch.device(device)
    if device.type != "cuda":
        return EndpointInfo(host=host or socket.gethostname(), device_kind=device.type)
    from cleave.transfer.cuda_ipc import gpu_uuid

    index = device.index if device.index is not None else torch.cuda.current_device()
    transports = {TransportKind.TCP, TransportKind.CUDA_IPC}
    if nccl_available:
        transports.add(TransportKind.NCCL)
    return EndpointInfo(host=host or socket.gethostname(), device_kind="cuda", device_index=index,
                        gpu_uuid=gpu_uuid(index), transports=frozenset(transports))
