"""`stack.start_stack` on an event loop of its own thread, for synchronous clients (schemathesis'
`Case.call`, blocking gRPC stubs, hypothesis' `@given`) that would block the test's loop."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tests.services.gateway.stack import Stack, start_stack

START_TIMEOUT_S = 120.0
STOP_TIMEOUT_S = 60.0


@contextlib.contextmanager
def threaded_stack(model_dir: Path, mode: str = "colocated", **options: Any) -> Iterator[Stack]:
    """A running stack served from a background thread; closed (and the thread joined) on
    every way out, a failed start included."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="fuzz-stack", daemon=True)
    thread.start()
    stack: Stack | None = None
    try:
        stack = asyncio.run_coroutine_threadsafe(start_stack(model_dir, mode, **options), loop).result(START_TIMEOUT_S)
        yield stack
    finally:
        if stack is not None:
            asyncio.run_coroutine_threadsafe(stack.close(), loop).result(STOP_TIMEOUT_S)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(STOP_TIMEOUT_S)
        loop.close()
