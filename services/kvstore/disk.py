"""Disk tier of the KV block store: one checksummed file per block, LRU by access.

A directory holds `layout.json` (the store's KV layout, so a restarted store refuses other
layouts) and `blocks/<first byte hex>/<hash hex>.kvb`, each file:
    b"CLKVB1\\0\\0" || u32le len(hash) || hash || u64le len(payload) || blake2b-256(hash || payload)
    || payload
Files are written to a temporary name, fsynced and renamed, so a crash leaves either the old
state or a whole file; `sync` then fsyncs the directories the renames changed (one call per
Put, however many blocks it wrote), after which the blocks survive a crash of the process or
the machine. A torn or corrupted file (wrong length, wrong checksum) is detected, deleted and
treated as absent: files found at `open` are checked only for their length there (a store of
many GiB must start at once) and are "unverified" until `verify` or a read checked their
checksum, so the store never counts one as stored before that.

`layout.json` that cannot be read as a layout is moved aside with the block files, into
`quarantine-<UTC time>/`, and the tier starts empty: a store that crash-looped on it would
serve nothing, and the blocks' layout is unknown without it.

The index (what is on disk, LRU order, bytes) changes at once, on the caller's event loop;
the files are written, read and deleted on one I/O thread, in the order the index changed,
so a later operation on a block always sees the earlier ones done. A block whose file is not
written yet is served from the payload it was put with. Checksumming and writing a 16 MiB
prompt's blocks takes tens of ms; on the event loop that would hold every Lookup behind it.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import struct
import threading
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from pathlib import Path

import structlog

from cleave.rpc.types import KVLayout

MAGIC = b"CLKVB1\0\0"
SUFFIX = ".kvb"
_HASH_LEN = struct.Struct("<I")
_PAYLOAD_LEN = struct.Struct("<Q")
_DIGEST_BYTES = 32
Buffer = bytes | memoryview  # a block's payload
MAX_UNWRITTEN_BYTES = 256 * 1024 * 1024  # queued writes beyond this make `throttle` wait


def _digest(block_hash: bytes, payload: Buffer) -> bytes:
    digest = hashlib.blake2b(digest_size=_DIGEST_BYTES)
    digest.update(block_hash)
    digest.update(payload)
    return digest.digest()


def _header_size(hash_len: int) -> int:
    return len(MAGIC) + _HASH_LEN.size + hash_len + _PAYLOAD_LEN.size + _DIGEST_BYTES


class DiskTier:
    """Blocks on disk with an in-memory LRU index (rebuilt from the directory at open); file
    I/O on one thread of its own (see the module docstring)."""

    def __init__(self, directory: Path, capacity_bytes: int, max_unwritten_bytes: int = MAX_UNWRITTEN_BYTES) -> None:
        self.directory = Path(directory)
        self.capacity_bytes = capacity_bytes
        self._index: OrderedDict[bytes, int] = OrderedDict()  # hash -> payload bytes, LRU first
        self.num_bytes = 0  # payload bytes on disk (or on their way there)
        self._io = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvstore-disk")  # FIFO
        self._unwritten: dict[bytes, Buffer] = {}  # indexed blocks whose file is not written yet
        self._unwritten_lock = threading.Lock()  # the I/O thread drops entries it has written
        self.num_unwritten_bytes = 0
        self.num_corrupt_files = 0  # written by the I/O thread only
        self._verified: set[bytes] = set()  # indexed blocks whose checksum is known good
        self._dirty_directories: set[Path] = set()  # I/O thread only: renamed into, not yet fsynced
        self.max_unwritten_bytes = max_unwritten_bytes
        self.log = structlog.get_logger("cleave.kvstore.disk").bind(directory=str(directory))

    # -- files ------------------------------------------------------------------------------

    def _path(self, block_hash: bytes) -> Path:
        name = block_hash.hex()
        return self.directory / "blocks" / name[:2] / f"{name}{SUFFIX}"

    def open(self) -> None:
        """Index the files already there, oldest access first; drop torn ones."""
        (self.directory / "blocks").mkdir(parents=True, exist_ok=True)
        _fsync_directory(self.directory)  # blocks/ itself, when it was just made
        found = []
        for path in (self.directory / "blocks").glob(f"*/*{SUFFIX}"):
            block_hash = self._check_file(path)
            if block_hash is None:
                self.log.warning("dropping torn block file", path=str(path))
                path.unlink(missing_ok=True)
                continue
            stat = path.stat()
            found.append((stat.st_mtime_ns, block_hash, stat.st_size))  # unverified: see the docstring
        for path in (self.directory / "blocks").glob("*/.*.tmp"):
            path.unlink(missing_ok=True)  # a write that never finished
        for _, block_hash, size in sorted(found):
            self._index[block_hash] = size - _header_size(len(block_hash))
            self.num_bytes += self._index[block_hash]

    def _check_file(self, path: Path) -> bytes | None:
        """The block hash of a file whose length matches its header, else None."""
        try:
            with path.open("rb") as file:
                head = file.read(len(MAGIC) + _HASH_LEN.size)
                if len(head) != len(MAGIC) + _HASH_LEN.size or head[: len(MAGIC)] != MAGIC:
                    return None
                (hash_len,) = _HASH_LEN.unpack(head[len(MAGIC):])
                block_hash = file.read(hash_len)
                (payload_len,) = _PAYLOAD_LEN.unpack(file.read(_PAYLOAD_LEN.size))
            if block_hash.hex() + SUFFIX != path.name:
                return None
            if path.stat().st_size != _header_size(hash_len) + payload_len:
                return None
            return block_hash
        except (OSError, struct.error):
            return None

    def read_layout(self) -> KVLayout | None:
        """The stored layout; None when there is none, or when it cannot be read (then it and
        the block files are moved aside first: see the module docstring). Call before `open`."""
        path = self.directory / "layout.json"
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as exc:
            return self._quarantine(path, f"cannot be read: {exc}")
        try:
            return KVLayout(**json.loads(data.decode("utf-8")))
        except (ValueError, TypeError) as exc:  # JSONDecodeError, UnicodeError, wrong fields
            return self._quarantine(path, f"is not a KV layout: {exc}")

    def _quarantine(self, layout_path: Path, reason: str) -> None:
        aside = self.directory / time.strftime("quarantine-%Y%m%dT%H%M%SZ", time.gmtime())
        aside.mkdir(parents=True, exist_ok=True)
        for name in ("layout.json", "blocks"):
            if (self.directory / name).exists():
                os.replace(self.directory / name, aside / name)
        _fsync_directory(self.directory)
        self.log.error(f"{layout_path} {reason}; moved it and the block files to {aside} and starting empty "
                       "(delete that directory once it is not needed)", path=str(layout_path), moved_to=str(aside))
        return None

    def write_layout(self, layout: KVLayout) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        tmp = self.directory / ".layout.json.tmp"
        with tmp.open("w") as file:
            file.write(json.dumps(asdict(layout), sort_keys=True))
            file.flush()
            os.fsync(file.fileno())
        tmp.replace(self.directory / "layout.json")
        _fsync_directory(self.directory)

    # -- blocks -----------------------------------------------------------------------------

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self._index

    def __len__(self) -> int:
        return len(self._index)

    def hashes(self) -> list[bytes]:
        """Every indexed block's hash, least recently used first."""
        return list(self._index)

    def touch(self, block_hash: bytes) -> None:
        self._index.move_to_end(block_hash)

    def is_verified(self, block_hash: bytes) -> bool:
        """Whether an indexed block's checksum is known good (written or read by this process)."""
        return block_hash in self._verified

    def put(self, block_hash: bytes, payload: Buffer) -> list[bytes]:
        """Index a block and queue its file; returns the hashes evicted to make room (oldest
        first). `payload` must not change afterwards (it is written later)."""
        if block_hash in self._index:
            self.touch(block_hash)
            return []
        evicted = []
        while self._index and self.num_bytes + len(payload) > self.capacity_bytes:
            oldest = next(iter(self._index))
            self.remove(oldest)
            evicted.append(oldest)
        if len(payload) > self.capacity_bytes:
            return [*evicted, block_hash]  # never fits: dropped
        self._index[block_hash] = len(payload)
        self._verified.add(block_hash)
        self.num_bytes += len(payload)
        with self._unwritten_lock:
            self._unwritten[block_hash] = payload
            self.num_unwritten_bytes += len(payload)
        self._io.submit(self._write_file, block_hash, payload)
        return evicted

    async def throttle(self) -> None:
        """Wait while more than `max_unwritten_bytes` are queued for writing (a writer faster
        than the disk would otherwise hold ever more payloads in memory)."""
        if self.num_unwritten_bytes > self.max_unwritten_bytes:
            await self.flush()

    def _write_file(self, block_hash: bytes, payload: Buffer) -> None:
        """On the I/O thread."""
        path = self._path(block_hash)
        try:
            if not path.parent.is_dir():
                path.parent.mkdir(parents=True, exist_ok=True)
                self._dirty_directories.add(path.parent.parent)  # the new directory's entry
            tmp = path.with_name(f".{path.name}.tmp")
            with tmp.open("wb") as file:
                file.write(MAGIC + _HASH_LEN.pack(len(block_hash)) + block_hash
                           + _PAYLOAD_LEN.pack(len(payload)) + _digest(block_hash, payload))
                file.write(payload)
                file.flush()
                os.fsync(file.fileno())
            tmp.replace(path)
            self._dirty_directories.add(path.parent)
        except OSError as exc:  # the read finds no file: a miss, and the block is dropped then
            self.log.error("cannot write block file", path=str(path), error=str(exc))
        with self._unwritten_lock:
            if self._unwritten.get(block_hash) is payload:
                del self._unwritten[block_hash]
                self.num_unwritten_bytes -= len(payload)

    def _read_file(self, block_hash: bytes) -> Buffer | None:
        """On the I/O thread: the payload of a whole, uncorrupted file, else None (a corrupt
        file is deleted here, before any later write of the same block)."""
        path = self._path(block_hash)
        try:
            data = path.read_bytes()
        except OSError:
            data = b""
        start = _header_size(len(block_hash))
        digest_at = start - _DIGEST_BYTES
        view = memoryview(data)
        if len(data) < start or data[: len(MAGIC)] != MAGIC or _digest(block_hash, view[start:]) != data[digest_at:start]:
            self.log.warning("dropping corrupt block file", path=str(path))
            self.num_corrupt_files += 1
            path.unlink(missing_ok=True)
            return None
        return view[start:]

    async def get(self, block_hash: bytes) -> Buffer | None:
        """The block's payload, or None (absent, or corrupt: then the file is deleted)."""
        if block_hash not in self._index:
            return None
        with self._unwritten_lock:
            payload = self._unwritten.get(block_hash)
        if payload is None:
            loop = asyncio.get_running_loop()
            payload = await loop.run_in_executor(self._io, self._read_file, block_hash)
        if block_hash not in self._index:
            return payload  # removed meanwhile; what was read is still the block's content
        if payload is None:
            with self._unwritten_lock:
                rewritten = block_hash in self._unwritten  # put again while it was read
            if not rewritten:
                self._forget(block_hash)
            return None
        self._verified.add(block_hash)
        self.touch(block_hash)
        return payload

    def _forget(self, block_hash: bytes) -> None:
        self.num_bytes -= self._index.pop(block_hash)
        self._verified.discard(block_hash)

    def _check_files(self, block_hashes: list[bytes]) -> list[bool]:
        """On the I/O thread: whether each block's file is whole and its checksum right (a
        corrupt one is deleted)."""
        return [self._read_file(block_hash) is not None for block_hash in block_hashes]

    async def verify(self, block_hashes: list[bytes]) -> set[bytes]:
        """Check the checksums of the unverified ones among `block_hashes` (on the I/O thread);
        returns those found corrupt, which are deleted and no longer indexed."""
        pending = [h for h in block_hashes if h in self._index and h not in self._verified]
        if not pending:
            return set()
        loop = asyncio.get_running_loop()
        results = await loop.run_in_executor(self._io, self._check_files, pending)
        corrupt = set()
        for block_hash, is_whole in zip(pending, results):
            if block_hash not in self._index:
                continue
            if is_whole:
                self._verified.add(block_hash)
                continue
            with self._unwritten_lock:
                rewritten = block_hash in self._unwritten
            if not rewritten:
                self._forget(block_hash)
                corrupt.add(block_hash)
        return corrupt

    def _sync_directories(self) -> None:
        """On the I/O thread: make the renames done so far durable."""
        while self._dirty_directories:
            directory = self._dirty_directories.pop()
            try:
                _fsync_directory(directory)
            except OSError as exc:
                self.log.error("cannot fsync a block directory", path=str(directory), error=str(exc))

    async def sync(self) -> None:
        """Wait until every block put so far is written, fsynced and its rename durable."""
        await asyncio.get_running_loop().run_in_executor(self._io, self._sync_directories)

    def remove(self, block_hash: bytes) -> None:
        size = self._index.pop(block_hash, None)
        self._verified.discard(block_hash)
        if size is not None:
            self.num_bytes -= size
            with self._unwritten_lock:
                payload = self._unwritten.pop(block_hash, None)
                if payload is not None:
                    self.num_unwritten_bytes -= len(payload)
            self._io.submit(self._path(block_hash).unlink, missing_ok=True)

    async def flush(self) -> None:
        """Wait for every write and delete queued so far."""
        await asyncio.get_running_loop().run_in_executor(self._io, lambda: None)

    async def close(self) -> None:
        """Wait for every queued write and delete, make them durable, then stop the I/O thread."""
        await self.sync()
        await asyncio.to_thread(self._io.shutdown, wait=True)


def _fsync_directory(directory: Path) -> None:
    descriptor = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)
