"""The two ends of one KV transfer, whatever carries it: `BaseKVSender` and `BaseKVReceiver`.

A transfer moves the K and V of a prompt's blocks from the prefill worker's cache into the
blocks a decode worker reserved (`TransferHandle.block_ids`, minus its cached prefix). The
data changes form on the way, per transport (one module each):

    sender cache [L, 2, NB, BS, Hkv, D] --send_layers(run)--> transport --accept(header)--> receiver cache
      cuda_ipc  fused block copy into the receiver's mapped cache; header (no bytes) after the copy's event
      nccl      gather [2, n, BS, Hkv, D] on the communicator's stream; header; ncclSend -> ncclRecv; scatter
      tcp       gather; pinned host staging; header + raw bytes on the socket; scatter
      memory    (tests, one process) header checked first, then a block copy straight into the cache

Both base classes keep the bookkeeping every transport shares (which layers went or arrived,
the checks of a chunk against the reservation, the single verdict); a subclass only moves
bytes. The sender hears the verdict through a `VerdictChannel`; the receiver's endpoint
(`cleave.transfer.receiver.KVReceiver`) owns one `BaseKVReceiver` per expected transfer.
"""

from __future__ import annotations

import asyncio
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import ClassVar, Protocol, Union

import torch

from cleave.errors import CleaveError, DeadlineExceeded, FailedPrecondition, InvalidArgument
from cleave.proto.cleave.v1 import common_pb2
from cleave.rpc.convert import dtype_to_proto
from cleave.rpc.types import TransferHandle, TransferStats, TransportKind
from cleave.transfer import framing
from cleave.transfer.head_staging import HeadStaging
from cleave.transfer.layer_frames import LayerLedger, header_layers
from cleave.transfer.layout import check_layout
from cleave.transfer.streams import Ready
from cleave.transfer.tensors import check_kv_cache, device_index, dtype_name, layer_chunk_shape

# What a receiving end reads a chunk's bytes from: the socket (TCP), nothing (CUDA IPC and
# NCCL: the header only announces them), or the sender's in-process write (memory).
Payload = Union[asyncio.StreamReader, Callable[[], None], None]


class VerdictChannel(Protocol):
    """Where a sender hears the receiver's verdict on a transfer (`BulkConnection`, or the
    receiver itself when both ends share a process)."""

    def result(self, transfer_id: str) -> asyncio.Future:
        """Future of the verdict: a result once every layer arrived, else the receiver's error."""

    def forget(self, transfer_id: str) -> None:
        """Stop tracking the transfer (its sender finished or closed)."""


class BaseKVSender(ABC):
    """Sending end of one transfer: moves the K and V of the sender's blocks into the blocks a
    TransferHandle reserved, a layer or a run of layers at a time, then waits once for the
    receiver's verdict.

    A subclass moves the bytes of a run (`_send_run`) and says what closing waits for
    (`_stop`); the checks, the layer accounting, the chunk headers and the verdict live here.
    `KVTransferClient.open` picks the subclass from the handle's transport.
    """

    def __init__(self, handle: TransferHandle, verdicts: VerdictChannel) -> None:
        self.handle = handle
        self._verdicts = verdicts
        self._result = verdicts.result(handle.transfer_id)
        self._dst_ids = handle.block_ids[handle.num_cached_blocks:]
        self._ledger: LayerLedger | None = None
        self._cache: torch.Tensor | None = None
        self._num_bytes = 0
        self._started = time.perf_counter()
        self._index_cache: dict[tuple, torch.Tensor] = {}
        self._ids_sent = False  # the first header names the blocks; later ones leave them out
        self._heads: HeadStaging | None = None  # set by select_heads: the receiver holds fewer heads

    def select_heads(self, heads: slice | None) -> None:
        """Send only these of the source cache's KV heads (`cleave.transfer.layout.head_slice`
        of the two layouts: a receiver in a tensor-parallel pool holds a slice); None sends
        the blocks whole. Call before the first send."""
        if self._ledger is not None:
            raise FailedPrecondition("the heads to send are chosen before the first send")
        self._heads = None if heads is None else HeadStaging(heads, self.num_blocks)

    @property
    def num_blocks(self) -> int:
        """Blocks this transfer moves (the handle's, minus the receiver's cached prefix)."""
        return len(self._dst_ids)

    @property
    def num_frames(self) -> int:
        """Control frames merged from runs of layers so far (CUDA IPC); 0 where every chunk
        is framed as it is sent."""
        return 0

    # -- the contract -----------------------------------------------------------------------

    async def send_layer(self, layer: int, cache: torch.Tensor, block_ids: Sequence[int],
                         ready: Ready = "current_stream") -> None:
        """Send one layer's K and V of `block_ids` (see `send_layers`)."""
        await self.send_layers(range(layer, layer + 1), cache, block_ids, ready)

    async def send_layers(self, layers: range, cache: torch.Tensor, block_ids: Sequence[int],
                          ready: Ready = "current_stream") -> None:
        """Send the K and V of `block_ids` (the sender's blocks, prompt order) of a run of
        layers, ordered after the KV's producer (`ready`, see `cleave.transfer.streams`).

        cache: [L, 2, NB, BS, Hkv, D]; block_ids: one per handle block, or one per block
        after the receiver's cached prefix.

        Blocks on: never the device or the receiver on CUDA IPC and NCCL (it returns once
        the work is queued); on TCP the gather's host copy (off the event loop) and the
        socket taking the bytes. Raises the receiver's error once it refused the transfer.
        """
        src_ids = self._source_ids(block_ids)
        if self._heads is not None:  # the receiver's heads, gathered into blocks of their own
            check_kv_cache(cache)
            cache, ready = self._heads.stage(layers, cache, src_ids, ready)
            src_ids = tuple(self._heads.block_ids)
        ledger = self._check(layers, cache)
        await self._send_run(layers, cache, src_ids, ready, ledger.completes(layers))
        ledger.add(layers)
        self._num_bytes += cache.element_size() * 2 * len(layers) * len(src_ids) * cache[0, 0, 0].numel()

    async def send_all(self, cache: torch.Tensor, block_ids: Sequence[int],
                       timeout_s: float | None = None, ready: Ready = "current_stream") -> TransferStats:
        """Send every layer as one run (CUDA IPC: one copy launch, one frame), then `finish`."""
        await self.send_layers(range(cache.shape[0]), cache, block_ids, ready)
        return await self.finish(timeout_s)

    async def finish(self, timeout_s: float | None = None) -> TransferStats:
        """Write the remaining frames and wait until the receiver confirms every layer
        (default: until the handle's deadline).

        Blocks on: the frames still queued behind their copies (CUDA IPC), then the
        receiver's verdict, once. Raises DeadlineExceeded on timeout, or the receiver's
        error when it refused (also before every layer was sent)."""
        if self._result.done() and self._result.exception() is not None:
            self._verdicts.forget(self.handle.transfer_id)
            raise self._result.exception()
        if self._ledger is None or not self._ledger.is_complete:
            sent = self._ledger.num_done if self._ledger else 0
            raise FailedPrecondition(
                f"{sent} layers sent of {self._ledger.num_layers if self._ledger else None}; send them all first")
        if timeout_s is None and self.handle.deadline_unix_s is not None:
            timeout_s = max(0.0, self.handle.deadline_unix_s - time.time())
        try:
            await self._flush()
            await asyncio.wait_for(asyncio.shield(self._result), timeout_s)
        except asyncio.TimeoutError:
            raise DeadlineExceeded(
                f"receiver did not confirm transfer {self.handle.transfer_id!r} in time") from None
        finally:
            self._verdicts.forget(self.handle.transfer_id)
        return TransferStats(transport=self.handle.transport, num_bytes=self._num_bytes,
                             seconds=time.perf_counter() - self._started, num_blocks=self.num_blocks)

    async def close(self) -> None:
        """Stop sending. Blocks until no queued device work of this transfer reads the
        source blocks or writes the receiver's any more (call before freeing the source
        blocks after a failure); never waits for the receiver."""
        await self._stop()
        self._verdicts.forget(self.handle.transfer_id)

    # -- what a transport implements --------------------------------------------------------

    @abstractmethod
    async def _send_run(self, layers: range, cache: torch.Tensor, src_ids: tuple[int, ...], ready: Ready,
                        is_last: bool) -> None:
        """Move `layers` of blocks `src_ids` into the handle's blocks (the run is checked;
        `is_last`: it completes the transfer). See `send_layers` for what it may block on."""

    async def _flush(self) -> None:
        """Write whatever frames are still queued (`finish` calls it before the verdict)."""

    @abstractmethod
    async def _stop(self) -> None:
        """Stop writing frames and wait for the device work already queued (`close`)."""

    # -- shared by the transports -----------------------------------------------------------

    def _check(self, layers: range, cache: torch.Tensor) -> LayerLedger:
        if self._result.done():
            self._result.result()  # the receiver already refused: raise its error
        deadline = self.handle.deadline_unix_s
        if deadline is not None and time.time() > deadline:
            raise DeadlineExceeded(f"transfer {self.handle.transfer_id!r} is past its deadline")
        if self._ledger is None:
            check_kv_cache(cache)
            if self.handle.layout is not None:
                check_layout(self.handle.layout, cache)
            self._ledger = LayerLedger(cache.shape[0])
            self._cache = cache
        self._ledger.check(layers)
        return self._ledger

    def _source_ids(self, block_ids: Sequence[int]) -> tuple[int, ...]:
        if len(block_ids) == len(self.handle.block_ids):
            return tuple(block_ids[self.handle.num_cached_blocks:])
        if len(block_ids) == len(self._dst_ids):
            return tuple(block_ids)
        raise InvalidArgument(
            f"got {len(block_ids)} source blocks for {len(self.handle.block_ids)} reserved "
            f"({self.handle.num_cached_blocks} cached)", field="block_ids")

    def _index(self, ids: Sequence[int], device: torch.device, stream: torch.cuda.Stream | None = None) -> torch.Tensor:
        """Block ids as an index tensor on `device`; on CUDA copied on `stream` from pinned
        memory, so building it never waits for the device."""
        key = (tuple(ids), device, stream)
        if key not in self._index_cache:
            self._index_cache[key] = device_index(ids, device, stream)
        return self._index_cache[key]

    def _header(self, layers: range, cache: torch.Tensor, byte_length: int, is_last: bool) -> common_pb2.KVChunkHeader:
        header = common_pb2.KVChunkHeader(
            transfer_id=self.handle.transfer_id, layer_index=layers.start, num_layers=len(layers),
            dtype=dtype_to_proto(dtype_name(cache.dtype)),
            shape=layer_chunk_shape(cache, len(self._dst_ids), len(layers)), byte_length=byte_length,
            is_last=is_last,
        )
        if not self._ids_sent:
            header.block_ids.extend(self._dst_ids)
            self._ids_sent = True
        return header


class BaseKVReceiver(ABC):
    """Receiving end of one transfer: checks each chunk's header against the reservation,
    lands its layers in the reserved blocks, and settles the transfer exactly once —
    complete when every layer arrived, failed on a refused chunk, a deadline or a cancel.

    A subclass lands the bytes (`_land`) and says whether they follow the header on the
    socket (`carries_payload`). Settling resolves `future` and writes the verdict frame to
    every connection the transfer's chunks came on.

    Args:
        cache: the receiver's KV cache, [L, 2, NB, BS, Hkv, D].
        transfer_id: the id chunk headers name.
        block_ids: destination blocks that receive data (the cached prefix left out).
        transport: the kind the handle names (reported in the stats).
        on_settled: called once, when the transfer settles (the endpoint forgets it).
    """

    carries_payload: ClassVar[bool] = False

    def __init__(self, cache: torch.Tensor, transfer_id: str, block_ids: Sequence[int], *,
                 transport: TransportKind, on_settled: Callable[[BaseKVReceiver], None]) -> None:
        self.cache = cache
        self.transfer_id = transfer_id
        self.block_ids = tuple(block_ids)
        self.transport = transport
        self.layers = LayerLedger(cache.shape[0])
        self.num_bytes = 0
        self.started = time.perf_counter()
        self.future: asyncio.Future[TransferStats] = asyncio.get_running_loop().create_future()
        self.future.add_done_callback(lambda f: f.exception() if not f.cancelled() else None)
        self.writers: list[asyncio.StreamWriter] = []  # connections to tell the verdict
        self._on_settled = on_settled
        self._index: torch.Tensor | None = None  # [n] int64 on the cache device, built on first use
        self._timer: asyncio.TimerHandle | None = None

    @property
    def is_settled(self) -> bool:
        return self.future.done()

    def index(self) -> torch.Tensor:
        """The destination block ids on the cache's device (built on first use, on the
        current stream: the one the landing runs on)."""
        if self._index is None:
            self._index = device_index(self.block_ids, self.cache.device)
        return self._index

    # -- the contract -----------------------------------------------------------------------

    async def accept(self, header: common_pb2.KVChunkHeader, payload: Payload = None) -> None:
        """Take one chunk: check its header, land its layers, complete the transfer when it
        was the last. A refused chunk fails the transfer and raises the refusal.

        Blocks on: reading the payload (TCP), the device work that lands it (waited off the
        event loop), or the sender's write (memory)."""
        try:
            layers, shape = self.check(header)
            await self._land(layers, shape, payload)
        except CleaveError as error:
            self.fail(error)
            raise
        self.layers.add(layers, field="layer_index")
        self.num_bytes += self.cache.element_size() * torch.Size(shape).numel()
        if self.layers.is_complete:
            self.complete()

    def check(self, header: common_pb2.KVChunkHeader) -> tuple[range, tuple[int, ...]]:
        """The chunk's layers and shape, or InvalidArgument when it does not fit the
        reservation (never blocks, touches no device)."""
        cache = self.cache
        layers = header_layers(header)
        self.layers.check(layers, field="layer_index")
        first_chunk = self.layers.num_done == 0  # it must name the block ids; later ones may not
        if (header.block_ids or first_chunk) and tuple(header.block_ids) != self.block_ids:
            raise InvalidArgument("block ids differ from the reserved ones", field="block_ids")
        if header.dtype != dtype_to_proto(dtype_name(cache.dtype)):
            raise InvalidArgument(
                f"dtype {common_pb2.DType.Name(header.dtype)} differs from the cache's {dtype_name(cache.dtype)}",
                field="dtype")
        shape = layer_chunk_shape(cache, len(self.block_ids), len(layers))
        if tuple(header.shape) != shape:
            raise InvalidArgument(f"shape {list(header.shape)} differs from the expected {list(shape)}", field="shape")
        expected_bytes = cache.element_size() * torch.Size(shape).numel() if self.carries_payload else 0
        if header.byte_length != expected_bytes:
            raise InvalidArgument(f"byte_length {header.byte_length} != {expected_bytes}", field="byte_length")
        if header.is_last and not self.layers.completes(layers):
            raise InvalidArgument("is_last set before every layer was sent", field="is_last")
        return layers, shape

    def complete(self) -> None:
        """Settle as done (every layer arrived): `future` gets the stats, senders a success frame."""
        self._settle(None)

    def fail(self, error: CleaveError) -> None:
        """Settle as failed (a no-op once settled): `future` raises `error`, senders get it as
        their verdict, later chunks are refused. The caller frees the reserved blocks."""
        self._settle(error)

    def expire_after(self, delay_s: float) -> None:
        """Fail with DeadlineExceeded unless settled within `delay_s` seconds."""
        self._timer = asyncio.get_running_loop().call_later(max(0.0, delay_s), self._expire)

    # -- what a transport implements --------------------------------------------------------

    @abstractmethod
    async def _land(self, layers: range, shape: tuple[int, ...], payload: Payload) -> None:
        """Put the chunk's layers (checked, `shape`) into blocks `index()`; raise a
        CleaveError to refuse it."""

    # -- settling ---------------------------------------------------------------------------

    def _expire(self) -> None:
        self.fail(DeadlineExceeded(
            f"transfer {self.transfer_id!r} did not complete in time ({self.layers.num_missing} of "
            f"{self.layers.num_layers} layers missing); its blocks must be freed"))

    def _settle(self, error: CleaveError | None) -> None:
        if self._timer is not None:
            self._timer.cancel()
        if self.future.done():
            return
        if error is None:
            self.future.set_result(TransferStats(
                transport=self.transport, num_bytes=self.num_bytes,
                seconds=time.perf_counter() - self.started, num_blocks=len(self.block_ids)))
        else:
            self.future.set_exception(error)
        self._on_settled(self)
        frame = framing.encode_frame(framing.verdict(self.transfer_id, error))
        for writer in self.writers:
            if not writer.is_closing():
                writer.write(frame)
