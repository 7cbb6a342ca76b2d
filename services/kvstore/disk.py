"""Disk tier of the KV block store: one checksummed file per block, LRU by access.

A directory holds `layout.json` (the store's KV layout, so a restarted store refuses other
layouts) and `blocks/<first byte hex>/<hash hex>.kvb`, each file:
    b"CLKVB1\\0\\0" || u32le len(hash) || hash || u64le len(payload) || blake2b-256(hash || payload)
    || payload
Files are written to a temporary name and renamed, so a crash leaves either the old state or
a whole file; a torn or corrupted file (wrong length, wrong checksum) is detected, deleted and
treated as absent. Disk I/O runs inline: one block is ~0.5 MB, a page-cache write.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections import OrderedDict
from dataclasses import asdict
from pathlib import Path

import structlog

from cleave.rpc.types import KVLayout

MAGIC = b"CLKVB1\0\0"
SUFFIX = ".kvb"
_HASH_LEN = struct.Struct("<I")
_PAYLOAD_LEN = struct.Struct("<Q")
_DIGEST_BYTES = 32


def _digest(block_hash: bytes, payload: bytes) -> bytes:
    digest = hashlib.blake2b(digest_size=_DIGEST_BYTES)
    digest.update(block_hash)
    digest.update(payload)
    return digest.digest()


def _header_size(hash_len: int) -> int:
    return len(MAGIC) + _HASH_LEN.size + hash_len + _PAYLOAD_LEN.size + _DIGEST_BYTES


class DiskTier:
    """Blocks on disk with an in-memory LRU index (rebuilt from the directory at open)."""

    def __init__(self, directory: Path, capacity_bytes: int) -> None:
        self.directory = Path(directory)
        self.capacity_bytes = capacity_bytes
        self._index: OrderedDict[bytes, int] = OrderedDict()  # hash -> file size, LRU first
        self.num_bytes = 0  # payload bytes on disk
        self.log = structlog.get_logger("cleave.kvstore.disk").bind(directory=str(directory))

    # -- files ------------------------------------------------------------------------------

    def _path(self, block_hash: bytes) -> Path:
        name = block_hash.hex()
        return self.directory / "blocks" / name[:2] / f"{name}{SUFFIX}"

    def open(self) -> None:
        """Index the files already there, oldest access first; drop torn ones."""
        (self.directory / "blocks").mkdir(parents=True, exist_ok=True)
        found = []
        for path in (self.directory / "blocks").glob(f"*/*{SUFFIX}"):
            block_hash = self._check_file(path)
            if block_hash is None:
                self.log.warning("dropping torn block file", path=str(path))
                path.unlink(missing_ok=True)
                continue
            stat = path.stat()
            found.append((stat.st_mtime_ns, block_hash, stat.st_size))
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
        path = self.directory / "layout.json"
        if not path.exists():
            return None
        return KVLayout(**json.loads(path.read_text()))

    def write_layout(self, layout: KVLayout) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        tmp = self.directory / ".layout.json.tmp"
        tmp.write_text(json.dumps(asdict(layout), sort_keys=True))
        tmp.replace(self.directory / "layout.json")

    # -- blocks -----------------------------------------------------------------------------

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self._index

    def __len__(self) -> int:
        return len(self._index)

    def touch(self, block_hash: bytes) -> None:
        self._index.move_to_end(block_hash)

    def put(self, block_hash: bytes, payload: bytes) -> list[bytes]:
        """Write a block; returns the hashes evicted to make room (oldest first)."""
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
        path = self._path(block_hash)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp")
        with tmp.open("wb") as file:
            file.write(MAGIC + _HASH_LEN.pack(len(block_hash)) + block_hash
                       + _PAYLOAD_LEN.pack(len(payload)) + _digest(block_hash, payload))
            file.write(payload)
        tmp.replace(path)
        self._index[block_hash] = len(payload)
        self.num_bytes += len(payload)
        return evicted

    def get(self, block_hash: bytes) -> bytes | None:
        """The block's payload, or None (absent, or corrupt: then the file is deleted)."""
        if block_hash not in self._index:
            return None
        path = self._path(block_hash)
        try:
            data = path.read_bytes()
        except OSError:
            data = b""
        start = _header_size(len(block_hash))
        digest_at = start - _DIGEST_BYTES
        if len(data) < start or data[: len(MAGIC)] != MAGIC or _digest(block_hash, data[start:]) != data[digest_at:start]:
            self.log.warning("dropping corrupt block file", path=str(path))
            self.remove(block_hash)
            return None
        self.touch(block_hash)
        return data[start:]

    def remove(self, block_hash: bytes) -> None:
        size = self._index.pop(block_hash, None)
        if size is not None:
            self.num_bytes -= size
            self._path(block_hash).unlink(missing_ok=True)
