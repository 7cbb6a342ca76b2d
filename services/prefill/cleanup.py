"""Cleanup that a cancellation must not cut short.

A gRPC handler's task can be cancelled while it is already unwinding from an error or from
an earlier cancellation (the client gives up on a call that is failing; a cancel that comes
while the handler awaits on its error path). `asyncio.shield` keeps the shielded work
running, but the awaiting caller still raises at once and skips whatever follows that
await: on a prefill's error path, the release of the prompt's KV blocks. `run_to_end` waits
for the whole cleanup instead, and reports the cancellation once it is done.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

T = TypeVar("T")


async def run_to_end(cleanup: Awaitable[T]) -> T:
    """Run `cleanup` in a task of its own and wait until it is done, however often the
    caller is cancelled meanwhile. Then raise the cleanup's error, or CancelledError if the
    caller was cancelled while it ran, or return its result."""
    task = asyncio.ensure_future(cleanup)
    cancelled = False
    while True:
        try:
            result = await asyncio.shield(task)
            break
        except asyncio.CancelledError:
            if task.done():  # the cleanup itself ended cancelled (e.g. the loop is closing)
                raise
            cancelled = True  # keep waiting: what follows the cleanup must not run early
    if cancelled:
        raise asyncio.CancelledError
    return result
