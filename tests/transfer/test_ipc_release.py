"""A sending worker lets go of a receiver's mapped CUDA IPC cache once the receiver's bulk
connection closes (the receiver died): the mapping would keep the dead decode worker's cache
allocated on the GPU, and its restart would find its share of the device taken. Another
receiver's cache stays mapped. (On the CPU the mapping is a stand-in tensor; the connection,
its close and the release are real.)"""

from __future__ import annotations

import asyncio

import pytest
import torch

from cleave.rpc.types import TransferHandle, TransportKind
from cleave.transfer import KVTransferClient, cuda_ipc

TIMEOUT_S = 30.0  # a guard against a hang; the waits end on events


@pytest.fixture
def mapped(monkeypatch):  # type: ignore[no-untyped-def]
    """Handles 'map' to stand-in tensors (no GPU here)."""
    monkeypatch.setattr(cuda_ipc.IpcTensorHandle, "from_bytes", staticmethod(lambda data: data))
    monkeypatch.setattr(cuda_ipc, "import_tensor", lambda handle: torch.zeros(4))


async def test_a_receivers_mapped_cache_is_released_when_its_connection_closes(mapped, monkeypatch):
    accepted: asyncio.Queue[asyncio.StreamWriter] = asyncio.Queue()

    async def accept(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await accepted.put(writer)

    server = await asyncio.start_server(accept, "127.0.0.1", 0)
    address = f"127.0.0.1:{server.sockets[0].getsockname()[1]}"
    client = KVTransferClient()
    released = asyncio.Event()
    receiver_gone = client._receiver_gone

    def noting(gone: str) -> None:
        receiver_gone(gone)
        released.set()

    monkeypatch.setattr(client, "_receiver_gone", noting)
    try:
        handle = TransferHandle(TransportKind.CUDA_IPC, address, "t-1", (0, 1), cuda_ipc_handle=b"decode-0's cache")
        await client.open(handle)  # connects to the receiver
        client.ipc_caches.open(handle.cuda_ipc_handle, address)
        client.ipc_caches.open(b"decode-1's cache", "127.0.0.1:1")
        assert client.ipc_caches.peers() == {address, "127.0.0.1:1"}
        receiver_end = await asyncio.wait_for(accepted.get(), TIMEOUT_S)
        receiver_end.close()  # the receiver died
        await asyncio.wait_for(released.wait(), TIMEOUT_S)
        assert client.ipc_caches.peers() == {"127.0.0.1:1"}  # the live receiver's stays mapped
    finally:
        await client.close()
        server.close()
        await server.wait_closed()
