"""Bytes on a fresh connection to a gateway's HTTP port, for requests httpx will not send
(malformed lines, non-ASCII header values, bodies that stop)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")


async def raw_exchange(port: int, sent: bytes, read: Callable[[asyncio.StreamReader], Awaitable[T]],
                       timeout_s: float = 10.0) -> T:
    """Send `sent` byte for byte and return what `read` takes from the answer within
    `timeout_s`; the connection is closed either way."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(sent)
        await writer.drain()
        return await asyncio.wait_for(read(reader), timeout=timeout_s)
    finally:
        writer.close()
