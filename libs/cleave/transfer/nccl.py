"""NCCL point-to-point through ctypes on the libnccl that torch ships (like vLLM's pynccl).

One two-rank communicator per prefill/decode GPU pair: the prefill worker (rank 0) makes a
unique id (`NcclLibrary.unique_id()`, 128 raw bytes), sends it in `HandshakeRequest.
nccl_unique_id`, and both sides call `NcclCommunicator.create` concurrently (it blocks until
both ranks joined). Each communicator owns a CUDA stream; sends and receives run on it.
NCCL refuses two ranks on one GPU: processes that share a GPU use CUDA IPC instead.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import glob
import importlib.util
import os
from pathlib import Path

import torch

from cleave.errors import FailedPrecondition, InvalidArgument, Unavailable

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

    def destroy(self, comm: ctypes.c_void_p) -> None:
        self.check(self._lib.ncclCommDestroy(comm), "ncclCommDestroy")


class NcclCommunicator:
    """A two-rank communicator of one prefill/decode GPU pair, with its own CUDA stream."""

    def __init__(self, library: NcclLibrary, comm: ctypes.c_void_p, rank: int, world_size: int,
                 device: torch.device, unique_id: bytes) -> None:
        self.library, self._comm = library, comm
        self.rank, self.world_size, self.device, self.unique_id = rank, world_size, device, unique_id
        self.stream = torch.cuda.Stream(device)

    @classmethod
    async def create(cls, unique_id: bytes, rank: int, device: torch.device | int | str,
                     world_size: int = 2, library: NcclLibrary | None = None) -> NcclCommunicator:
        """Join the communicator (returns once every rank joined; runs off the event loop)."""
        library = library or NcclLibrary()
        device = torch.device(device if not isinstance(device, int) else f"cuda:{device}")
        if device.type != "cuda":
            raise FailedPrecondition("NCCL needs a CUDA device")

        def init() -> ctypes.c_void_p:
            with torch.cuda.device(device):
                return library.init_rank(unique_id, world_size, rank)

        comm = await asyncio.to_thread(init)
        return cls(library, comm, rank, world_size, device, unique_id)

    def send(self, tensor: torch.Tensor, peer: int) -> None:
        """Enqueue a send of a contiguous CUDA tensor's bytes on `stream`."""
        self.library.send(tensor, peer, self._comm, self.stream.cuda_stream)

    def recv(self, tensor: torch.Tensor, peer: int) -> None:
        """Enqueue a receive into a contiguous CUDA tensor on `stream`."""
        self.library.recv(tensor, peer, self._comm, self.stream.cuda_stream)

    def close(self) -> None:
        if self._comm:
            self.library.destroy(self._comm)
            self._comm = ctypes.c_void_p()
