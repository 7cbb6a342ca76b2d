"""NCCL transport: point-to-point through ctypes on the libnccl that torch ships (like vLLM's
pynccl).

One two-rank communicator per prefill/decode GPU pair: the prefill worker (rank 0) makes a
unique id (`NcclLibrary.unique_id()`, 128 raw bytes), sends it in `HandshakeRequest.
nccl_unique_id`, and both sides call `NcclCommunicator.create` concurrently (it blocks until
both ranks joined). Each communicator owns a CUDA stream; sends and receives run on it.
NCCL refuses two ranks on one GPU: processes that share a GPU use CUDA IPC instead. A
one-rank communicator (`NcclCommunicator.loopback`) sends to itself, so one GPU can run the
whole NCCL path (tests): NCCL runs a send to oneself only inside one group with its receive,
so it holds each send until the matching receive and issues the two as a group.

`NcclKVSender`: per layer, gather `[2, n, BS, Hkv, D]` on the communicator's stream after the
producer's event, write the header, then `ncclSend` the chunk; the stream keeps the order, no
host wait per layer. `NcclKVReceiver`: on a header, `ncclRecv` into a buffer and scatter it,
on the same stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import ctypes.util
import glob
import importlib.util
import os
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import torch

from cleave.errors import FailedPrecondition, InvalidArgument, Unavailable
from cleave.rpc.types import TransferHandle, TransportKind
from cleave.transfer.base import BaseKVReceiver, BaseKVSender, Payload
from cleave.transfer.connection import BulkConnection
from cleave.transfer.streams import Ready, order_after, run_on_device, wait_stream
from cleave.transfer.tensors import gather_layer, scatter_layers

UNIQUE_ID_BYTES = 128
NCCL_UINT8 = 1  # ncclDataType_t ncclUint8
_LIBRARY_NAMES = ("libnccl.so.2", "libnccl.so")


class NcclUniqueId(ctypes.Structure):
    """ncclUniqueId: an opaque 128-byte struct passed by value."""

    _fields_ = [("internal", ctypes.c_byte * UNIQUE_ID_BYTES)]


def unique_id_from_bytes(data: bytes) -> NcclUniqueId:
    if len(data) != UNIQUE_ID_BYTES:
        raise InvalidArgument(f"an NCCL unique id is {UNIQUE_ID_BYTES} bytes, got {len(data)}", field="nccl_unique_id")
    unique_id = NcclUniqueId()
    ctypes.memmove(ctypes.addressof(unique_id), data, UNIQUE_ID_BYTES)
    return unique_id


def unique_id_to_bytes(unique_id: NcclUniqueId) -> bytes:
    return ctypes.string_at(ctypes.addressof(unique_id), UNIQUE_ID_BYTES)


def library_candidates() -> list[str]:
    """Where libnccl may be, most specific first: the nvidia-nccl wheel, torch's lib dir,
    a copy this process already loaded (torch_cuda links it), the system loader path."""
    paths: list[str] = []
    spec = importlib.util.find_spec("nvidia")
    for root in (spec.submodule_search_locations or []) if spec else []:
        paths += sorted(glob.glob(os.path.join(root, "nccl", "lib", "libnccl.so*")))
        paths += sorted(glob.glob(os.path.join(root, "cu1*", "lib", "libnccl.so*")))
    torch_lib = Path(torch.__file__).parent / "lib"
    paths += sorted(str(p) for p in torch_lib.glob("libnccl.so*"))
    maps = Path("/proc/self/maps")
    if maps.exists():
        for line in maps.read_text().splitlines():
            path = line.rsplit(" ", 1)[-1]
            if "libnccl.so" in os.path.basename(path) and path not in paths:
                paths.append(path)
    system = ctypes.util.find_library("nccl")
    if system:
        paths.append(system)
    return paths


class NcclLibrary:
    """The few NCCL entry points cleave uses."""

    def __init__(self, path: str | None = None) -> None:
        candidates = [path] if path else [*library_candidates(), *_LIBRARY_NAMES]
        errors = []
        for candidate in candidates:
            try:
                self._lib = ctypes.CDLL(candidate)
                self.path = candidate
                break
            except OSError as exc:
                errors.append(f"{candidate}: {exc}")
        else:
            raise Unavailable(
                "cannot load libnccl (install torch with CUDA or nvidia-nccl-cu12/cu13, or pass "
                f"its path); tried: {'; '.join(errors) or 'nothing found'}")
        lib = self._lib
        lib.ncclGetErrorString.restype = ctypes.c_char_p
        lib.ncclGetErrorString.argtypes = [ctypes.c_int]
        lib.ncclGetVersion.argtypes = [ctypes.POINTER(ctypes.c_int)]
        lib.ncclGetUniqueId.argtypes = [ctypes.POINTER(NcclUniqueId)]
        lib.ncclCommInitRank.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_int, NcclUniqueId, ctypes.c_int]
        for name in ("ncclSend", "ncclRecv"):
            getattr(lib, name).argtypes = [
                ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]
        lib.ncclGroupStart.argtypes = []
        lib.ncclGroupEnd.argtypes = []
        lib.ncclCommDestroy.argtypes = [ctypes.c_void_p]

    def check(self, result: int, call: str) -> None:
        if result != 0:
            message = self._lib.ncclGetErrorString(result).decode(errors="replace")
            raise Unavailable(f"{call} failed: NCCL error {result}: {message}")

    @property
    def version(self) -> int:
        value = ctypes.c_int()
        self.check(self._lib.ncclGetVersion(ctypes.byref(value)), "ncclGetVersion")
        return value.value

    def unique_id(self) -> bytes:
        """A fresh communicator id (rank 0 makes it and sends it to its peer)."""
        unique_id = NcclUniqueId()
        self.check(self._lib.ncclGetUniqueId(ctypes.byref(unique_id)), "ncclGetUniqueId")
        return unique_id_to_bytes(unique_id)

    def init_rank(self, unique_id: bytes, world_size: int, rank: int) -> ctypes.c_void_p:
        comm = ctypes.c_void_p()
        self.check(self._lib.ncclCommInitRank(
            ctypes.byref(comm), world_size, unique_id_from_bytes(unique_id), rank), "ncclCommInitRank")
        return comm

    def send(self, tensor: torch.Tensor, peer: int, comm: ctypes.c_void_p, stream: int) -> None:
        self.check(self._lib.ncclSend(
            ctypes.c_void_p(tensor.data_ptr()), tensor.numel() * tensor.element_size(),
            NCCL_UINT8, peer, comm, ctypes.c_void_p(stream)), "ncclSend")

    def recv(self, tensor: torch.Tensor, peer: int, comm: ctypes.c_void_p, stream: int) -> None:
        self.check(self._lib.ncclRecv(
            ctypes.c_void_p(tensor.data_ptr()), tensor.numel() * tensor.element_size(),
            NCCL_UINT8, peer, comm, ctypes.c_void_p(stream)), "ncclRecv")

    def group_start(self) -> None:
        self.check(self._lib.ncclGroupStart(), "ncclGroupStart")

    def group_end(self) -> None:
        """Issue the operations queued since `group_start` (returns once they are enqueued)."""
        self.check(self._lib.ncclGroupEnd(), "ncclGroupEnd")

    @contextlib.contextmanager
    def group(self) -> Iterator[None]:
        """Queue the sends and receives of the block and issue them together at its end
        (groups are per thread)."""
        self.group_start()
        try:
            yield
        finally:
            self.group_end()

    def destroy(self, comm: ctypes.c_void_p) -> None:
        self.check(self._lib.ncclCommDestroy(comm), "ncclCommDestroy")


class NcclCommunicator:
    """A communicator of one prefill/decode GPU pair (two ranks), or of one GPU with itself
    (one rank, `loopback`), with its own CUDA stream.

    Args:
        stream: where sends and receives run (default: a new stream on `device`).
    """

    def __init__(self, library: NcclLibrary, comm: ctypes.c_void_p, rank: int, world_size: int,
                 device: torch.device, unique_id: bytes, stream: torch.cuda.Stream | None = None) -> None:
        self.library, self._comm = library, comm
        self.rank, self.world_size, self.device, self.unique_id = rank, world_size, device, unique_id
        self.stream = stream if stream is not None else torch.cuda.Stream(device)
        self._held_sends: deque[torch.Tensor] = deque()  # one rank: sends awaiting their receive

    @property
    def peer(self) -> int:
        """The rank transfers go to and come from: the other one, or itself on one rank."""
        return 1 - self.rank if self.world_size == 2 else self.rank

    @property
    def num_held_sends(self) -> int:
        """Sends of a one-rank communicator still waiting for their receive."""
        return len(self._held_sends)

    @classmethod
    async def create(cls, unique_id: bytes, rank: int, device: torch.device | int | str,
                     world_size: int = 2, library: NcclLibrary | None = None) -> NcclCommunicator:
        """Join the communicator (returns once every rank joined; runs off the event loop)."""
        if world_size not in (1, 2):
            raise InvalidArgument(
                f"cleave's NCCL communicators have 2 ranks (a GPU pair) or 1 (loopback), not {world_size}",
                field="world_size")
        if not 0 <= rank < world_size:
            raise InvalidArgument(f"rank {rank} outside [0, {world_size})", field="rank")
        device = torch.device(device if not isinstance(device, int) else f"cuda:{device}")
        if device.type != "cuda":
            raise FailedPrecondition(f"NCCL needs a CUDA device, not {device}; use the TCP transport")
        unique_id_from_bytes(unique_id)  # its length, before a rank blocks waiting for peers
        library = library or NcclLibrary()

        def init() -> ctypes.c_void_p:
            with torch.cuda.device(device):
                return library.init_rank(unique_id, world_size, rank)

        comm = await asyncio.to_thread(init)
        return cls(library, comm, rank, world_size, device, unique_id)

    @classmethod
    async def loopback(cls, device: torch.device | int | str, library: NcclLibrary | None = None) -> NcclCommunicator:
        """A one-rank communicator on `device` whose sends reach its own receives."""
        library = library or NcclLibrary()
        return await cls.create(library.unique_id(), rank=0, device=device, world_size=1, library=library)

    def _check_peer(self, peer: int) -> None:
        if not 0 <= peer < self.world_size:
            raise InvalidArgument(f"peer {peer} outside [0, {self.world_size})", field="peer")

    def send(self, tensor: torch.Tensor, peer: int) -> None:
        """Enqueue a send of a contiguous CUDA tensor's bytes on `stream` (on one rank: with
        the next `recv`; keep the tensor unchanged until then)."""
        self._check_peer(peer)
        if self.world_size == 1:
            self._held_sends.append(tensor)
            return
        self.library.send(tensor, peer, self._comm, self.stream.cuda_stream)

    def recv(self, tensor: torch.Tensor, peer: int) -> None:
        """Enqueue a receive into a contiguous CUDA tensor on `stream` (on one rank: grouped
        with the oldest held send, which must be as large)."""
        self._check_peer(peer)
        if self.world_size > 1:
            self.library.recv(tensor, peer, self._comm, self.stream.cuda_stream)
            return
        if not self._held_sends:
            raise FailedPrecondition(
                "a one-rank NCCL communicator receives only what it sent: no send is waiting "
                "(call send before recv)")
        sent = self._held_sends[0]
        if sent.nbytes != tensor.nbytes:
            raise InvalidArgument(
                f"the waiting send has {sent.nbytes} bytes, the receive buffer {tensor.nbytes}", field="tensor")
        self._held_sends.popleft()
        with self.library.group():  # a send to oneself runs only grouped with its receive
            self.library.send(sent, peer, self._comm, self.stream.cuda_stream)
            self.library.recv(tensor, peer, self._comm, self.stream.cuda_stream)

    def close(self) -> None:
        self._held_sends.clear()
        if self._comm:
            self.library.destroy(self._comm)
            self._comm = ctypes.c_void_p()


class NcclKVSender(BaseKVSender):
    """Gathers each layer on the communicator's stream and sends it after its header."""

    def __init__(self, handle: TransferHandle, connection: BulkConnection, comm: NcclCommunicator) -> None:
        super().__init__(handle, connection)
        self._connection = connection
        self._comm = comm

    async def _send_run(self, layers: range, cache: torch.Tensor, src_ids: tuple[int, ...], ready: Ready,
                        is_last: bool) -> None:
        comm = self._comm
        stream = comm.stream
        order_after(stream, ready, cache.device)
        index = self._index(src_ids, cache.device, stream)
        for layer in layers:
            with torch.cuda.stream(stream):
                chunk = gather_layer(cache, layer, index)  # [2, n, BS, Hkv, D], freed in stream order
            header = self._header(range(layer, layer + 1), cache, 0, is_last and layer == layers[-1])
            # Header and send under one lock: the receiver posts its receives in header order.
            async with self._connection.lock:
                await self._connection.write_chunk(header)
                with torch.cuda.stream(stream):
                    comm.send(chunk, peer=comm.peer)

    async def _stop(self) -> None:
        await wait_stream(self._comm.stream)


class NcclKVReceiver(BaseKVReceiver):
    """Receives each announced chunk from the peer and scatters it, on the communicator's stream."""

    def __init__(self, cache: torch.Tensor, transfer_id: str, block_ids: Sequence[int], *,
                 comm: NcclCommunicator, transport: TransportKind,
                 on_settled: Callable[[BaseKVReceiver], None]) -> None:
        super().__init__(cache, transfer_id, block_ids, transport=transport, on_settled=on_settled)
        self._comm = comm

    async def _land(self, layers: range, shape: tuple[int, ...], payload: Payload) -> None:
        comm, cache = self._comm, self.cache

        def receive() -> None:
            buffer = torch.empty(shape, dtype=cache.dtype, device=cache.device)
            comm.recv(buffer, peer=comm.peer)
            scatter_layers(cache, layers, self.index(), buffer)

        await run_on_device(cache, receive, stream=comm.stream)
