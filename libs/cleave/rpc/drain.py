"""`DrainGate`: a backend's draining state, shared by every service that drains for real.

A service backend holds one gate. `Server` drains it on SIGTERM (`cleave.rpc.server.Drainable`):
the backend closes the gate, from then on every new piece of work is refused with
Unavailable (UNAVAILABLE with `retry-after-ms`, HTTP 503 with `Retry-After`) so the caller
tries another replica, while the work admitted before goes on; the backend's `drain()`
returns once that work is done (`wait_until`), and the server stops.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from cleave.errors import Unavailable

DRAIN_POLL_S = 0.02  # how often a drain looks at the admitted work (cheap checks of dict sizes)


class DrainGate:
    """Open until the service drains; then new work is refused.

    Args:
        what: the service as an error names it ("decode worker decode-0").
    """

    def __init__(self, what: str) -> None:
        self.what = what
        self.is_draining = False

    def close(self) -> None:
        """Refuse new work from now on."""
        self.is_draining = True

    def error(self) -> Unavailable:
        """What a refused caller gets: UNAVAILABLE with a retry hint."""
        return Unavailable(f"{self.what} is draining (shutting down) and takes no new work; retry on another one")

    def check(self) -> None:
        """Raise `error()` while draining (call before admitting new work)."""
        if self.is_draining:
            raise self.error()


async def wait_until(is_done: Callable[[], bool], poll_s: float = DRAIN_POLL_S) -> None:
    """Return once `is_done()` holds (the caller bounds the wait)."""
    while not is_done():
        await asyncio.sleep(poll_s)
