"""What the routing backend tells about each request's path: where it started, moves, and the
tokens it had when it ended.

`services.gateway.metered.MeteredBackend` is the one listener (request metrics); the routing
backend calls `NO_ROUTE_OBSERVER` when nobody listens.
"""

from __future__ import annotations

from typing import Protocol

from cleave.rpc.types import Usage


class RouteObserver(Protocol):
    """Hears the routing backend's decisions (on the event loop; must not block)."""

    def routed(self, request_id: str, remote_prefill: bool, decode_worker: str) -> None:
        """The request starts on `decode_worker`, its prompt prefilled there or on a prefill worker."""

    def migrated(self, request_id: str) -> None:
        """The request moves (once more) to another decode worker."""

    def ended(self, request_id: str, usage: Usage) -> None:
        """The request's stream ended, however it ended (finished, failed, cancelled), once its
        prompt was computed: its prompt and the tokens generated until then."""


class _Unobserved:
    def routed(self, request_id: str, remote_prefill: bool, decode_worker: str) -> None:
        return None

    def migrated(self, request_id: str) -> None:
        return None

    def ended(self, request_id: str, usage: Usage) -> None:
        return None


NO_ROUTE_OBSERVER: RouteObserver = _Unobserved()
