"""Which bulk transport two workers use, from where their ends live."""

from __future__ import annotations

import socket
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
