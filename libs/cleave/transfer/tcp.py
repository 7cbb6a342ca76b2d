"""TCP transport: the KV travels as raw bytes after its chunk header on the bulk socket.

Sender: per layer, gather the blocks into `[2, n, BS, Hkv, D]`, stage them through pinned
host memory when the cache is on CUDA, write header + bytes. Receiver: read the bytes into a
(pinned) staging buffer, reinterpret them as the chunk and scatter it into the reserved
blocks. Works between any two hosts and devices, CPU caches included.
"""

from __future__ import annotations

import asyncio

import torch

from cleave.device_copy import to_host
from cleave.rpc.types import TransferHandle
from cleave.transfer import framing
from cleave.transfer.base import BaseKVReceiver, BaseKVSender, Payload
from cleave.transfer.connection import BulkConnection
from cleave.transfer.streams import Ready, run_on_device, wait_stream
from cleave.transfer.tensors import as_bytes, from_bytes, gather_layer, scatter_layers


class TcpKVSender(BaseKVSender):
    """Sends each layer's gathered blocks as bytes on the bulk connection."""

    def __init__(self, handle: TransferHandle, connection: BulkConnection) -> None:
        super().__init__(handle, connection)
        self._connection = connection

    async def _send_run(self, layers: range, cache: torch.Tensor, src_ids: tuple[int, ...], ready: Ready,
                        is_last: bool) -> None:
        # `ready` needs no handling: the gather runs on the current stream, after its producer.
        for layer in layers:
            chunk = gather_layer(cache, layer, self._index(src_ids, cache.device))  # [2, n, BS, Hkv, D]
            if chunk.is_cuda:
                host = to_host(chunk)
                await wait_stream(torch.cuda.current_stream(chunk.device))
                chunk = host
            payload = as_bytes(chunk)
            header = self._header(range(layer, layer + 1), cache, len(payload), is_last and layer == layers[-1])
            async with self._connection.lock:
                await self._connection.write_chunk(header, payload)

    async def _stop(self) -> None:
        """Nothing is left queued: each send waited for its host copy."""


class TcpKVReceiver(BaseKVReceiver):
    """Reads a chunk's bytes off the socket and scatters them into the reserved blocks."""

    carries_payload = True

    async def _land(self, layers: range, shape: tuple[int, ...], payload: Payload) -> None:
        assert isinstance(payload, asyncio.StreamReader)
        cache = self.cache
        staging = torch.empty(cache.element_size() * torch.Size(shape).numel(), dtype=torch.uint8,
                              pin_memory=cache.is_cuda)
        await framing.read_payload(payload, as_bytes(staging))
        chunk = from_bytes(staging, cache.dtype, shape)  # [2, n, BS, Hkv, D] or [k, 2, n, BS, Hkv, D]
        await run_on_device(cache, lambda: scatter_layers(
            cache, layers, self.index(), chunk.to(cache.device, non_blocking=True)))
