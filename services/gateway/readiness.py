"""Whether the gateway can route a request now, and who is told when that changes.

A request needs a decode worker in rotation whose Attach stream is open
(`DecodePlacement.candidates()`); prefill workers are not required: with none in rotation a
disaggregated gateway prefills on the decode worker, as conditional mode may and colocated
mode always does (`RoutingBackend._start`), so the stack degrades instead of refusing.
`RoutingBackend` calls `Routability.update()` after every event that may change that — a
worker entering or leaving the rotation, a worker lost, an Attach stream closing — and the
watchers hear each change: the gRPC server's health (`cleave.rpc.Server.follow`), so a load
balancer stops sending traffic to a gateway that would only answer UNAVAILABLE. HTTP
`/ready` reads `Routability.reason` directly.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import structlog

from cleave.rpc.server import ReadyCallback

log = structlog.get_logger("cleave.gateway")
Mode = Literal["disaggregated", "colocated", "conditional"]


def unroutable_reason(mode: Mode, num_prefill_in_rotation: int, num_decode_candidates: int) -> str | None:
    """Why no request can be routed now, or None when one can.

    Args:
        mode: the gateway's mode (every mode can prefill on a decode worker).
        num_prefill_in_rotation: prefill workers in rotation (reported, not required).
        num_decode_candidates: decode workers in rotation with an open Attach stream.
    """
    if num_decode_candidates == 0:
        return "no decode worker is in rotation with an open token stream; check the decode workers' health"
    return None


class Routability:
    """The gateway's readiness: `is_ready` while a request can be routed (a
    `cleave.rpc.Readiness`).

    Args:
        reason: the current `unroutable_reason` of the gateway's workers.
    """

    def __init__(self, reason: Callable[[], str | None]) -> None:
        self._reason = reason
        self._watchers: list[ReadyCallback] = []
        self._last_ready: bool | None = None  # as last told to the watchers

    @property
    def reason(self) -> str | None:
        """Why no request can be routed now; None when one can."""
        return self._reason()

    @property
    def is_ready(self) -> bool:
        return self._reason() is None

    def watch(self, on_change: ReadyCallback) -> None:
        """Have `on_change(is_ready)` awaited at every change from now on."""
        self._watchers.append(on_change)

    async def update(self) -> None:
        """Tell the watchers if routability changed since the last update."""
        reason = self._reason()
        ready = reason is None
        if ready == self._last_ready:
            return
        was_ready, self._last_ready = self._last_ready, ready
        if ready:
            log.info("gateway routable")
        elif was_ready is not None:
            log.warning("gateway not routable", reason=reason)
        for on_change in list(self._watchers):
            await on_change(ready)
