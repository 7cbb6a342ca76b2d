"""Sender side of one bulk socket: chunks go out one at a time, result frames come back.

Several transfers to the same receiver share one connection; each frame (header + bytes) is
written under a lock so frames never interleave, and the NCCL transport relies on that order
to pair its sends with the receiver's receives.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from cleave.errors import (
    CleaveError,
    DeadlineExceeded,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    Unavailable,
)
from cleave.proto.cleave.v1 import common_pb2
from cleave.tls import TlsConfig, server_name
from cleave.transfer import framing

_ERRORS: dict[int, type[CleaveError]] = {
    common_pb2.ERROR_CODE_INVALID_ARGUMENT: InvalidArgument,
    common_pb2.ERROR_CODE_NOT_FOUND: NotFound,
    common_pb2.ERROR_CODE_DEADLINE_EXCEEDED: DeadlineExceeded,
    common_pb2.ERROR_CODE_FAILED_PRECONDITION: FailedPrecondition,
}


def error_from_reply(reply: common_pb2.ErrorDetail) -> CleaveError | None:
    """The receiver's verdict as a domain error (None: the transfer completed)."""
    if reply.code == common_pb2.ERROR_CODE_UNSPECIFIED:
        return None
    return _ERRORS.get(reply.code, Unavailable)(f"receiver refused the transfer: {reply.message}")


class BulkConnection:
    """One TCP connection from a sender to a receiver's bulk endpoint."""

    def __init__(self, address: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.address = address
        self.lock = asyncio.Lock()  # held while writing one frame (and enqueuing its NCCL send)
        self._reader, self._writer = reader, writer
        self._results: dict[str, asyncio.Future] = {}
        self._reader_task = asyncio.ensure_future(self._read_results())

    @classmethod
    async def open(cls, address: str, timeout_s: float = 10.0, internal_token: str | None = None, *,
                   tls: TlsConfig | None = None) -> BulkConnection:
        """Connect (over TLS with `tls`, the receiver's certificate checked against the host
        dialled); with `internal_token` the connection opens with it (`framing.encode_hello`),
        written ahead of the first chunk."""
        host, _, port = address.rpartition(":")
        secure = {} if tls is None else {"ssl": tls.client_context(), "server_hostname": server_name(address)}
        try:
            reader, writer = await asyncio.wait_for(asyncio.open_connection(host, int(port), **secure), timeout_s)
        except (OSError, asyncio.TimeoutError) as exc:  # ssl.SSLError is an OSError
            raise Unavailable(f"cannot reach the KV receiver at {address}: {exc}") from None
        if internal_token is not None:
            writer.write(framing.encode_hello(internal_token))
        return cls(address, reader, writer)

    @property
    def is_closed(self) -> bool:
        return self._reader_task.done() or self._writer.is_closing()

    def on_closed(self, callback: Callable[[], None]) -> None:
        """Call `callback()` once the connection is closed (by either end: a receiver that
        died closes it too)."""
        self._reader_task.add_done_callback(lambda _: callback())

    def result(self, transfer_id: str) -> asyncio.Future:
        """Future of the receiver's verdict on a transfer (registered before its first chunk)."""
        future = self._results.get(transfer_id)
        if future is None or future.done():
            future = self._results[transfer_id] = asyncio.get_running_loop().create_future()
            future.add_done_callback(_consume)
            if self.is_closed:
                future.set_exception(Unavailable(f"connection to {self.address} is closed"))
        return future

    def forget(self, transfer_id: str) -> None:
        self._results.pop(transfer_id, None)

    async def write_chunk(self, header: common_pb2.KVChunkHeader, payload: memoryview | None = None) -> None:
        """Write one frame; the caller holds `lock`."""
        if self.is_closed:
            raise Unavailable(f"connection to the KV receiver at {self.address} is closed")
        self._writer.write(framing.encode_frame(header))
        if payload is not None and len(payload):
            self._writer.write(payload)
        try:
            await self._writer.drain()
        except ConnectionError as exc:
            raise Unavailable(f"KV receiver at {self.address} dropped the connection: {exc}") from None

    async def _read_results(self) -> None:
        try:
            while True:
                reply = await framing.read_reply(self._reader)
                future = self._results.pop(reply.request_id, None)
                if future is not None and not future.done():
                    error = error_from_reply(reply)
                    future.set_exception(error) if error else future.set_result(None)
        except (asyncio.IncompleteReadError, ConnectionError, CleaveError):
            pass
        finally:
            for future in self._results.values():
                if not future.done():
                    future.set_exception(Unavailable(f"KV receiver at {self.address} closed the connection"))
            self._results.clear()

    async def close(self) -> None:
        self._writer.close()
        self._reader_task.cancel()
        await asyncio.gather(self._reader_task, return_exceptions=True)


def _consume(future: asyncio.Future) -> None:
    """Mark a verdict's error as seen: a sender that gave up early never awaits it."""
    if not future.cancelled():
        future.exception()
