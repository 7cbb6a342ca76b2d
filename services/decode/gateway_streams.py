"""Per-gateway step streams of a decode worker.

The engine thread hands over each step's outputs at once; the backend turns them into
RequestDeltas and `publish`es them per gateway. Each gateway has one outbox: deltas of one
step (and of any steps the gateway's stream did not keep up with) leave as ONE StepOutput,
so the message rate follows the step rate, never tokens x requests. Deltas published before
the gateway attaches are kept for it; a gateway whose stream ended is detached and its
deltas are dropped until it attaches again.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Sequence

from cleave.rpc.types import RequestDelta, StepOutput, WorkerLoad


class _Outbox:
    """Deltas waiting for one gateway, and which Attach call currently reads them."""

    def __init__(self) -> None:
        self.deltas: list[RequestDelta] = []
        self.step = 0
        self.ready = asyncio.Event()
        self.owner: object | None = None
        self.detached = False


class GatewayStreams:
    """Outboxes of every gateway that has requests on this worker.

    Args:
        load: the worker's load, attached to a StepOutput at most every `load_interval_s`.
        on_detach: called with a gateway id when its stream ends without a replacement (the
            backend aborts that gateway's requests: nobody would receive their tokens).
    """

    def __init__(
        self,
        load: Callable[[], WorkerLoad],
        on_detach: Callable[[str], None],
        load_interval_s: float = 1.0,
    ) -> None:
        self._load = load
        self._on_detach = on_detach
        self._load_interval_s = load_interval_s
        self._outboxes: dict[str, _Outbox] = {}
        self._closed = False

    def publish(self, gateway_id: str, deltas: Sequence[RequestDelta], step: int) -> None:
        """Queue deltas for a gateway (dropped when its stream ended)."""
        outbox = self._outboxes.setdefault(gateway_id, _Outbox())
        if outbox.detached or not deltas:
            return
        outbox.deltas.extend(deltas)
        outbox.step = step
        outbox.ready.set()

    def is_attached(self, gateway_id: str) -> bool:
        outbox = self._outboxes.get(gateway_id)
        return outbox is not None and outbox.owner is not None

    @property
    def num_attached(self) -> int:
        """Gateways with an open Attach stream now."""
        return sum(1 for outbox in self._outboxes.values() if outbox.owner is not None)

    async def attach(self, gateway_id: str) -> AsyncIterator[StepOutput]:
        """The gateway's stream; a second attach with the same id ends the first."""
        outbox = self._outboxes.setdefault(gateway_id, _Outbox())
        token = object()
        outbox.owner, outbox.detached = token, False
        outbox.ready.set()  # wake a previous reader so it sees it was replaced
        last_load = 0.0
        try:
            while not self._closed:
                await outbox.ready.wait()
                if outbox.owner is not token or self._closed:
                    return
                outbox.ready.clear()
                if not outbox.deltas:
                    continue
                deltas, outbox.deltas = outbox.deltas, []
                now = time.monotonic()
                load = None
                if now - last_load >= self._load_interval_s:
                    load, last_load = self._load(), now
                yield StepOutput(step=outbox.step, deltas=tuple(deltas), load=load)
        finally:
            if outbox.owner is token:
                outbox.owner, outbox.detached = None, True
                outbox.deltas.clear()
                if not self._closed:
                    self._on_detach(gateway_id)

    def is_flushed(self) -> bool:
        """Whether every attached gateway's stream took all its deltas."""
        return not any(outbox.deltas for outbox in self._outboxes.values() if outbox.owner is not None)

    def close(self) -> None:
        """End every stream (the worker drains)."""
        self._closed = True
        for outbox in self._outboxes.values():
            outbox.ready.set()
