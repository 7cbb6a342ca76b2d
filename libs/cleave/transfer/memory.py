"""In-memory transport: both ends in one process; the sender copies straight into the
receiver's cache. No sockets, no device IPC: tests of the handoff run the real sender and
receiver bookkeeping (headers checked against the reservation, layers accounted, one verdict,
deadlines) on CPU caches.

    receiver = MemoryEndpoint(decode_cache)       # a KVReceiver without a socket
    await receiver.start()
    transfers = MemoryTransferClient(receiver)     # where a KVTransferClient would stand
    pending = receiver.expect("t", dst_ids, timeout_s=5)
    sender = await transfers.open(pending.handle)  # a MemoryKVSender
    await sender.send_all(prefill_cache, src_ids)
    await pending.wait()

Each run of layers is offered to the receiving end as a header first; only once the end
accepted it does the sender's block copy write the reserved blocks, so a refused chunk
leaves them untouched. A copy that fails part-way fails the transfer at the receiver
(`Unavailable`, its blocks hold partial KV and must be freed) and the sender hears the same.
Handles keep the transport the receiver was asked for (TCP by default): the in-memory path
stands in for it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence

import torch

from cleave.errors import CleaveError, FailedPrecondition, NotFound, Unavailable
from cleave.rpc.types import TransferHandle, TransportKind
from cleave.transfer.base import BaseKVReceiver, BaseKVSender, Payload
from cleave.transfer.block_copy import copy_blocks
from cleave.transfer.receiver import KVReceiver
from cleave.transfer.streams import Ready, order_after, run_on_device

# copy(src, dst, src_ids, dst_ids, layers): `cleave.transfer.block_copy.copy_blocks`'s signature
BlockCopy = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, range], None]


class MemoryKVReceiver(BaseKVReceiver):
    """Receiving end whose chunks are written by the sender's copy, run once the header passed."""

    async def _land(self, layers: range, shape: tuple[int, ...], payload: Payload) -> None:
        assert callable(payload)
        try:
            await run_on_device(self.cache, payload)
        except CleaveError:
            raise
        except Exception as error:
            raise Unavailable(
                f"transfer {self.transfer_id!r} failed while layers {layers.start}..{layers.stop - 1} were "
                f"written ({type(error).__name__}: {error}); its blocks hold partial KV and must be freed") from error


class MemoryEndpoint(KVReceiver):
    """A `KVReceiver` without a socket: its transfers are filled in this process by
    `MemoryKVSender`s. It is also their `VerdictChannel`."""

    def __init__(self, kv_cache: torch.Tensor, **kwargs) -> None:
        super().__init__(kv_cache, **kwargs)
        self._started = False

    @property
    def address(self) -> str:
        """memory://<id>: the name `MemoryTransferClient` knows this endpoint by."""
        if not self._started:
            raise FailedPrecondition("MemoryEndpoint.start() has not been called")
        return f"memory://{id(self):x}"

    async def start(self) -> None:
        """Accept transfers (nothing listens)."""
        self._started = True

    def receiving_end(self, transfer_id: str) -> MemoryKVReceiver:
        """The end of an expected transfer; NotFound once it settled or if never expected."""
        end = self._transfers.get(transfer_id)
        if end is None:
            raise NotFound(f"unknown transfer id {transfer_id!r} (expired, finished or never registered)")
        assert isinstance(end, MemoryKVReceiver)
        return end

    def result(self, transfer_id: str) -> asyncio.Future:
        """The transfer's verdict (a failed future when the id is unknown)."""
        try:
            return self.receiving_end(transfer_id).future
        except NotFound as error:
            future = asyncio.get_running_loop().create_future()
            future.set_exception(error)
            future.add_done_callback(lambda f: f.exception())
            return future

    def forget(self, transfer_id: str) -> None:
        """Nothing to drop: the verdict lives with the receiving end."""

    def _receiving_end(self, transport: TransportKind, transfer_id: str, block_ids: Sequence[int],
                       nccl: object) -> MemoryKVReceiver:
        return MemoryKVReceiver(self.kv_cache, transfer_id, block_ids, transport=transport, on_settled=self._forget)


class MemoryKVSender(BaseKVSender):
    """Copies runs of layers straight into a `MemoryEndpoint`'s cache, after its end accepted
    each run's header.

    Args:
        copy: the block copy (default `copy_blocks`; a test passes one that fails part-way).
    """

    def __init__(self, handle: TransferHandle, receiver: MemoryEndpoint, copy: BlockCopy = copy_blocks) -> None:
        super().__init__(handle, receiver)
        self._receiver = receiver
        self._copy = copy

    async def _send_run(self, layers: range, cache: torch.Tensor, src_ids: tuple[int, ...], ready: Ready,
                        is_last: bool) -> None:
        end = self._receiver.receiving_end(self.handle.transfer_id)
        dst = end.cache
        if dst.device != cache.device:
            raise FailedPrecondition(
                f"the in-memory transport copies within one device, not {cache.device} -> {dst.device}")
        if cache.is_cuda:  # the copy runs on the current stream, after the KV's producer
            order_after(torch.cuda.current_stream(cache.device), ready, cache.device)
        src_index = self._index(src_ids, cache.device)
        header = self._header(layers, cache, 0, is_last)
        await end.accept(header, lambda: self._copy(cache, dst, src_index, end.index(), layers))

    async def _stop(self) -> None:
        """Nothing is left queued: each run's copy finished before `send_layers` returned."""


class MemoryTransferClient:
    """Opens `MemoryKVSender`s to in-process `MemoryEndpoint`s by their address; it stands
    where a `KVTransferClient` would (`open`, `close`).

    Args:
        receivers: the endpoints handles may name (more with `add`).
        copy: the block copy every sender uses (see `MemoryKVSender`).
    """

    def __init__(self, *receivers: MemoryEndpoint, copy: BlockCopy = copy_blocks) -> None:
        self._receivers: dict[str, MemoryEndpoint] = {}
        self._copy = copy
        for receiver in receivers:
            self.add(receiver)

    def add(self, receiver: MemoryEndpoint) -> None:
        """Let handles naming `receiver.address` reach it (after its `start()`)."""
        self._receivers[receiver.address] = receiver

    async def open(self, handle: TransferHandle) -> MemoryKVSender:
        """A sender for one transfer into the endpoint the handle names."""
        receiver = self._receivers.get(handle.address)
        if receiver is None:
            raise Unavailable(f"no in-process KV receiver at {handle.address!r}; add its MemoryEndpoint first")
        return MemoryKVSender(handle, receiver, self._copy)

    async def close(self) -> None:
        self._receivers.clear()
