"""Engine steps to gateway streams: every step's outputs become `RequestDelta`s, one
`StepOutput` per gateway (`GatewayStreams.publish`), counted for the load report's token rate.

The engine thread calls `_on_step`; it hands the whole step to the event loop in one callback,
where the request table is read and the deltas are built (`DeltaBuilder`, which prepends a
disaggregated request's first-token logprobs from the prefill worker to its first delta).
"""

from __future__ import annotations

import asyncio
import collections
import time
from dataclasses import dataclass, field, replace

from cleave.generation.outputs import RequestOutput
from cleave.rpc.types import RequestDelta
from cleave.tracing import record_span
from cleave.worker import DeltaBuilder
from services.decode.admission import HeldRequest
from services.decode.admission_queue import AdmissionQueue
from services.decode.gateway_streams import GatewayStreams

RATE_WINDOW_S = 5.0


@dataclass
class TokenRate:
    """Generated tokens per second over the last few seconds."""

    events: collections.deque = field(default_factory=collections.deque)

    def add(self, num_tokens: int) -> None:
        now = time.monotonic()
        self.events.append((now, num_tokens))
        while self.events and now - self.events[0][0] > RATE_WINDOW_S:
            self.events.popleft()

    def per_second(self) -> float:
        if not self.events:
            return 0.0
        span = max(time.monotonic() - self.events[0][0], 1e-3)
        return sum(count for _, count in self.events) / max(span, 1.0)


def without_delivered_first(deltas: list[RequestDelta], delivered: set[int]) -> list[RequestDelta]:
    """Drop the first token (and its logprobs) of each sample in `delivered` from its first
    delta, and the sample from `delivered`; a delta left with no token and no finish goes."""
    kept = []
    for delta in deltas:
        if delta.sample_index in delivered:
            delivered.discard(delta.sample_index)
            delta = replace(
                delta,
                token_ids=delta.token_ids[1:],
                logprobs=delta.logprobs[1:],
                num_reasoning_tokens=min(delta.num_reasoning_tokens, len(delta.token_ids) - 1),
            )
            if not delta.token_ids and delta.finish_reason is None:
                continue
        kept.append(delta)
    return kept


class StepDeliveryMixin:
    """`EngineDecodeBackend`'s step delivery (the engine's `on_step` callback)."""

    streams: GatewayStreams
    _requests: dict[str, HeldRequest]
    _builder: DeltaBuilder
    _rate: TokenRate
    _step: int  # written by the engine thread only
    _loop: asyncio.AbstractEventLoop | None
    admissions: AdmissionQueue

    def _on_step(self, outputs: list[RequestOutput]) -> None:
        """Engine thread: hand the whole step to the event loop in one callback."""
        self._step += 1
        if self._loop is not None:
            try:
                self._loop.call_soon_threadsafe(self._publish, self._step, outputs)
            except RuntimeError:  # the loop closed during shutdown
                pass

    def _publish(self, step: int, outputs: list[RequestOutput]) -> None:
        by_gateway: dict[str, list[RequestDelta]] = {}
        num_tokens = 0
        for output in outputs:
            request = self._requests.get(output.request_id)
            if request is None:
                continue
            deltas = self._builder.build(output, request.leading_logprobs)
            request.leading_logprobs = ()
            if request.trace_start is not None:
                start = request.trace_start
                record_span("decode.first_step", start.arrival_ns, time.time_ns(), parent=start.context,
                            request_id=request.request_id)
                request.trace_start = None
            if request.delivered_first:
                deltas = without_delivered_first(deltas, request.delivered_first)
            if output.finished:
                del self._requests[output.request_id]
            num_tokens += sum(len(delta.token_ids) for delta in deltas)
            by_gateway.setdefault(request.gateway_id, []).extend(deltas)
        self._rate.add(num_tokens)
        for gateway_id, deltas in by_gateway.items():
            self.streams.publish(gateway_id, deltas, step)
        self.admissions.wake()  # the step may have freed blocks (finished or preempted requests)
