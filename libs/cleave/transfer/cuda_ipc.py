"""CUDA IPC transport: the sender copies straight into the receiver's cache on the same GPU.

The receiver exports its cache once (`export_tensor(...).to_bytes()` travels in
`TransferHandle.cuda_ipc_handle`); the sender opens it once per handle (`IpcCacheMap`).
`CudaIpcKVSender` copies a run of layers, after the producer's event, on the client's copy
stream in one fused launch (`cleave.transfer.block_copy`); a `FramePump` writes the chunk
header (no bytes) once the copy's event completed, merging runs that finished together.
Nothing waits per layer: `send_layers` returns at once, and only the pump waits on the
copy's event (not on the device, and not on the receiver). `CudaIpcKVReceiver` has nothing
to land: the header says which layers are already in the blocks.

The handle's fields are those torch's own `reduce_tensor` produces for a CUDA tensor
(`UntypedStorage._share_cuda_()`); we encode them ourselves instead of pickling the rebuild
call. Encoding (version 1), all integers little-endian:
    b"CLVIPC1\\0"
    str gpu_uuid, u32 device (exporter's index), bytes handle, u64 storage_size_bytes,
    u64 storage_offset_bytes, bytes ref_counter_handle, u64 ref_counter_offset,
    bytes event_handle, u8 event_sync_required, str dtype, u64 tensor_offset (elements),
    u8 ndim, ndim x i64 shape, ndim x i64 stride
where `bytes`/`str` are u32 length || data.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from dataclasses import dataclass

import torch

from cleave.device_copy import tensor_on
from cleave.errors import FailedPrecondition, InvalidArgument
from cleave.rpc.types import TransferHandle
from cleave.transfer.base import BaseKVReceiver, BaseKVSender, Payload
from cleave.transfer.block_copy import copy_blocks
from cleave.transfer.connection import BulkConnection
from cleave.transfer.frame_pump import EventCompletion, FramePump
from cleave.transfer.streams import Ready, order_after
from cleave.transfer.tensors import dtype_name, torch_dtype

MAGIC = b"CLVIPC1\0"


@dataclass(frozen=True)
class IpcTensorHandle:
    """Everything another process needs to map a CUDA tensor of this one."""

    gpu_uuid: str
    device: int
    handle: bytes
    storage_size_bytes: int
    storage_offset_bytes: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes
    event_sync_required: bool
    dtype: str
    tensor_offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]

    def to_bytes(self) -> bytes:
        parts = [MAGIC]

        def blob(data: bytes) -> None:
            parts.append(struct.pack("<I", len(data)))
            parts.append(data)

        blob(self.gpu_uuid.encode())
        parts.append(struct.pack("<I", self.device))
        blob(self.handle)
        parts.append(struct.pack("<QQ", self.storage_size_bytes, self.storage_offset_bytes))
        blob(self.ref_counter_handle)
        parts.append(struct.pack("<Q", self.ref_counter_offset))
        blob(self.event_handle)
        parts.append(struct.pack("<B", int(self.event_sync_required)))
        blob(self.dtype.encode())
        parts.append(struct.pack("<QB", self.tensor_offset, len(self.shape)))
        parts.append(struct.pack(f"<{len(self.shape)}q", *self.shape))
        parts.append(struct.pack(f"<{len(self.stride)}q", *self.stride))
        return b"".join(parts)

    @classmethod
    def from_bytes(cls, data: bytes) -> IpcTensorHandle:
        reader = _Reader(data)
        if reader.take(len(MAGIC)) != MAGIC:
            raise InvalidArgument("not a cleave CUDA IPC handle (bad magic)", field="cuda_ipc_handle")
        try:
            gpu_uuid = reader.blob().decode()
            (device,) = reader.unpack("<I")
            handle = reader.blob()
            storage_size, storage_offset = reader.unpack("<QQ")
            ref_counter_handle = reader.blob()
            (ref_counter_offset,) = reader.unpack("<Q")
            event_handle = reader.blob()
            (event_sync_required,) = reader.unpack("<B")
            dtype = reader.blob().decode()
            tensor_offset, ndim = reader.unpack("<QB")
            shape = reader.unpack(f"<{ndim}q")
            stride = reader.unpack(f"<{ndim}q")
        except (struct.error, UnicodeDecodeError) as exc:
            raise InvalidArgument(f"truncated CUDA IPC handle: {exc}", field="cuda_ipc_handle") from None
        if reader.remaining:
            raise InvalidArgument(f"{reader.remaining} trailing bytes in CUDA IPC handle", field="cuda_ipc_handle")
        torch_dtype(dtype)
        return cls(gpu_uuid, device, handle, storage_size, storage_offset, ref_counter_handle,
                   ref_counter_offset, event_handle, bool(event_sync_required), dtype,
                   tensor_offset, tuple(shape), tuple(stride))


class _Reader:
    def __init__(self, data: bytes) -> None:
        self._data, self._position = memoryview(data), 0

    @property
    def remaining(self) -> int:
        return len(self._data) - self._position

    def take(self, size: int) -> bytes:
        if size > self.remaining:
            raise struct.error(f"needs {size} bytes, {self.remaining} left")
        chunk = bytes(self._data[self._position : self._position + size])
        self._position += size
        return chunk

    def unpack(self, fmt: str) -> tuple:
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))

    def blob(self) -> bytes:
        (size,) = self.unpack("<I")
        return self.take(size)


def gpu_uuid(device_index: int) -> str:
    """UUID of a CUDA device as torch reports it (stable across CUDA_VISIBLE_DEVICES)."""
    return str(torch.cuda.get_device_properties(device_index).uuid)


def local_device_for(uuid: str) -> int:
    """Index, in this process, of the GPU with `uuid`."""
    for index in range(torch.cuda.device_count()):
        if gpu_uuid(index) == uuid:
            return index
    raise FailedPrecondition(
        f"GPU {uuid} is not visible to this process; CUDA IPC needs both ends on one GPU "
        "(use the NCCL or TCP transport)")


def export_tensor(tensor: torch.Tensor) -> IpcTensorHandle:
    """Share a CUDA tensor's allocation; keep `tensor` alive while peers use the handle."""
    if not tensor.is_cuda:
        raise InvalidArgument("only CUDA tensors can be shared through CUDA IPC")
    storage = tensor.untyped_storage()
    (device, handle, size, offset, ref_handle, ref_offset, event_handle, event_sync) = storage._share_cuda_()
    return IpcTensorHandle(
        gpu_uuid=gpu_uuid(tensor.device.index), device=int(device), handle=bytes(handle),
        storage_size_bytes=int(size), storage_offset_bytes=int(offset),
        ref_counter_handle=bytes(ref_handle), ref_counter_offset=int(ref_offset),
        event_handle=bytes(event_handle or b""), event_sync_required=bool(event_sync),
        dtype=dtype_name(tensor.dtype), tensor_offset=tensor.storage_offset(),
        shape=tuple(tensor.shape), stride=tuple(tensor.stride()),
    )


def import_tensor(handle: IpcTensorHandle) -> torch.Tensor:
    """Map a tensor exported by another process on the same GPU (a view of its memory)."""
    device = local_device_for(handle.gpu_uuid)
    torch.cuda._lazy_init()
    storage = torch.UntypedStorage._new_shared_cuda(
        device, handle.handle, handle.storage_size_bytes, handle.storage_offset_bytes,
        handle.ref_counter_handle, handle.ref_counter_offset,
        handle.event_handle, handle.event_sync_required,
    )
    tensor = torch.empty(0, dtype=torch_dtype(handle.dtype), device=f"cuda:{device}")
    return tensor.set_(storage, handle.tensor_offset, handle.shape, handle.stride)


class IpcCacheMap:
    """A sender's opened peer caches, by handle bytes: each handle is opened once, and kept
    until its peer is gone (`forget_peer`).

    A mapped cache keeps the peer's allocation alive on the GPU after the peer died: the
    device frees it only once every process that mapped it let go. A decode worker's cache is
    most of its share of the device, so a restarted decode worker would find its share still
    taken by its dead predecessor's cache, mapped here, and fail to start.
    """

    def __init__(self) -> None:
        self._tensors: dict[bytes, tuple[str, torch.Tensor]] = {}  # handle bytes -> (peer, its mapped cache)

    def open(self, handle_bytes: bytes, peer: str = "") -> torch.Tensor:
        """The cache `handle_bytes` exports, mapped on first use; `peer`: who exported it (the
        receiver's bulk address), for `forget_peer`."""
        opened = self._tensors.get(handle_bytes)
        if opened is None:
            opened = self._tensors[handle_bytes] = (peer, import_tensor(IpcTensorHandle.from_bytes(handle_bytes)))
        return opened[1]

    def forget_peer(self, peer: str) -> int:
        """Let go of every cache `peer` exported (it died, or its connection broke: a live
        peer's cache is mapped again on its next transfer); returns how many. A copy still in
        flight into one must have finished (the caller synchronises its copy streams)."""
        gone = [handle for handle, (owner, _) in self._tensors.items() if owner == peer]
        for handle in gone:
            del self._tensors[handle]
        return len(gone)

    def peers(self) -> set[str]:
        """The peers whose caches are mapped now."""
        return {owner for owner, _ in self._tensors.values()}

    def __len__(self) -> int:
        return len(self._tensors)

    def clear(self) -> None:
        self._tensors.clear()


class CudaIpcKVSender(BaseKVSender):
    """Copies runs of layers into the receiver's mapped cache on the copy stream; frames
    each run once its copy finished.

    Args:
        caches: the client's opened peer caches (the handle's is opened on first send).
        copy_stream: the stream copies run on, per device (apart from the engine's).
    """

    def __init__(self, handle: TransferHandle, connection: BulkConnection, caches: IpcCacheMap,
                 copy_stream: Callable[[torch.device], torch.cuda.Stream]) -> None:
        super().__init__(handle, connection)
        self._connection = connection
        self._caches = caches
        self._copy_stream = copy_stream
        self._pair_cache: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}  # (source, destination)
        self._pump: FramePump | None = None  # frames, written as copies finish
        self._num_layers_framed = 0

    @property
    def num_frames(self) -> int:
        return self._pump.num_frames if self._pump is not None else 0

    def _pair_index(self, src_ids: tuple[int, ...], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Source and destination block ids as two index tensors staged in one host-to-device
        copy on the current stream (built once per source-id sequence)."""
        key = (src_ids, device)
        pair = self._pair_cache.get(key)
        if pair is None:
            both = tensor_on([*src_ids, *self._dst_ids], torch.int64, device)  # [2n]
            pair = self._pair_cache[key] = (both[: len(src_ids)], both[len(src_ids):])
        return pair

    async def _send_run(self, layers: range, cache: torch.Tensor, src_ids: tuple[int, ...], ready: Ready,
                        is_last: bool) -> None:
        if not cache.is_cuda:
            raise FailedPrecondition("the CUDA IPC transport needs a CUDA KV cache")
        dst = self._caches.open(self.handle.cuda_ipc_handle, self.handle.address)
        if dst.shape[0] != cache.shape[0] or dst.shape[3:] != cache.shape[3:] or dst.dtype != cache.dtype:
            raise FailedPrecondition(
                f"receiver cache {dst.dtype} {list(dst.shape)} does not match {cache.dtype} {list(cache.shape)}")
        stream = self._copy_stream(cache.device)
        order_after(stream, ready, cache.device)
        with torch.cuda.stream(stream):
            src_index, dst_index = self._pair_index(src_ids, cache.device)
            copy_blocks(cache, dst, src_index, dst_index, layers)
            done = torch.cuda.Event()
            done.record(stream)
        if self._pump is None:
            self._pump = FramePump(self._write_frame)
        # The receiver reads the blocks once the header arrives: the pump writes it after `done`.
        self._pump.submit(layers, EventCompletion(done))

    async def _write_frame(self, layers: range) -> None:
        assert self._cache is not None and self._ledger is not None
        self._num_layers_framed += len(layers)
        is_last = self._num_layers_framed == self._ledger.num_layers
        async with self._connection.lock:
            await self._connection.write_chunk(self._header(layers, self._cache, 0, is_last))

    async def _flush(self) -> None:
        if self._pump is not None:
            await self._pump.flush()

    async def _stop(self) -> None:
        if self._pump is not None:
            await self._pump.close()


class CudaIpcKVReceiver(BaseKVReceiver):
    """Nothing to land: the sender wrote the blocks before their header was sent."""

    async def _land(self, layers: range, shape: tuple[int, ...], payload: Payload) -> None:
        return None
