"""`MeteredBackend`: the gateway's request metrics around its serving logic.

The servicer and the OpenAI HTTP API both hand requests to a `GatewayBackend`; this one wraps
the routing backend and times each request from arrival to its last chunk
(`cleave.metrics.gateway`), so gRPC and HTTP requests are counted once, the same way. The
routing backend reports where it started each request and each migration to the same
`GatewayMetrics` (its `RouteObserver`), which gives the queue time and the routing counters.

Per chunk it does a clock read and, after the first, one histogram sample: the per-token
work stays in the decode worker's step messages.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

from cleave.metrics.gateway import GatewayMetrics, RequestClock
from cleave.rpc.errors import map_exception
from cleave.scaling.strategies import Strategy
from services.gateway.backend import BackendLayer, GatewayBackend, GenerateChunk, GenerateSpec


def _carries_output(chunk: GenerateChunk) -> bool:
    return any(sample.text or sample.reasoning_text or sample.token_ids for sample in chunk.samples)


class MeteredBackend(BackendLayer):
    """A GatewayBackend that records request metrics around `backend`.

    Args:
        backend: the serving logic (`RoutingBackend`).
        metrics: the gateway's series.
    """

    def __init__(self, backend: GatewayBackend, metrics: GatewayMetrics) -> None:
        super().__init__(backend)
        self.metrics = metrics
        self._num_waiting = 0  # no first token yet
        self._num_running = 0
        metrics.track_in_flight(lambda: self._num_running, lambda: self._num_waiting)

    # ---- requests --------------------------------------------------------------------------

    async def generate(self, spec: GenerateSpec) -> AsyncIterator[GenerateChunk]:
        metrics, request_id = self.metrics, spec.request_id
        clock = RequestClock()
        if spec.scaling.strategy is not Strategy.NONE:
            metrics.scaled(spec.scaling.strategy.value, spec.scaling.num_samples)
        metrics.arrived(request_id, clock)
        self._num_waiting += 1
        finish_reasons: dict[int, str] = {}
        last: GenerateChunk | None = None
        try:
            # aclosing: a caller that stops reading (a cancelled call) closes the inner stream
            # at once, which ends the request on its worker and in the router's table, instead
            # of leaving that to the garbage collector
            async with contextlib.aclosing(self.backend.generate(spec)) as chunks:
                async for chunk in chunks:
                    if _carries_output(chunk):
                        now = time.perf_counter()
                        if clock.first_token is None:
                            clock.first_token = now
                            metrics.ttft.observe(now - clock.arrival)
                            self._num_waiting -= 1
                            self._num_running += 1
                        else:
                            metrics.itl.observe(now - clock.last_token)  # type: ignore[operator]
                        clock.last_token = now
                    for sample in chunk.samples:
                        if sample.finish_reason is not None:
                            finish_reasons.setdefault(sample.index, sample.finish_reason.value)
                    last = chunk
                    yield chunk
        except BaseException as exc:  # noqa: BLE001 - counted, then re-raised
            cancelled = isinstance(exc, (asyncio.CancelledError, GeneratorExit))
            metrics.failed("CANCELLED" if cancelled else map_exception(exc, request_id).code.name, request_id,
                           spec.tenant)
            raise
        else:
            if clock.first_token is None:  # nothing streamed before the end: the end is the first token
                clock.first_token = time.perf_counter()
                metrics.ttft.observe(clock.first_token - clock.arrival)
                self._num_waiting -= 1
                self._num_running += 1
            usage = last.usage if last is not None else None
            reason = finish_reasons[min(finish_reasons)] if finish_reasons else "unknown"
            metrics.finished(
                clock, reason,
                prompt_tokens=usage.prompt_tokens if usage else 0,
                generation_tokens=usage.completion_tokens if usage else 0,
                reasoning_tokens=usage.reasoning_tokens if usage else 0,
                cached_prompt_tokens=usage.cached_prompt_tokens if usage else 0,
                tenant=spec.tenant,
            )
        finally:
            if clock.first_token is None:
                self._num_waiting -= 1
            else:
                self._num_running -= 1
            metrics.left(request_id)
