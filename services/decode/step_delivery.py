"""Engine steps to gateway streams: every step's outputs become `RequestDelta`s, one
`StepOutput` per gateway (`GatewayStreams.publish`), counted for the load report's token rate.

The engine thread calls `on_step`; it hands the whole step to the event loop in one callback,
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
from services.decode.admission import Admissions
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


class StepDelivery:
    """Engine steps to gateway streams (see the module docstring).

    Owns the step counter, the delta builder and the token rate. Reads the held requests
    from `Admissions` (`held`), hands back the ones the engine finished (`finish`) and wakes
    its queue after each step, since a step may have freed blocks.

    Args:
        admissions: the worker's table of held requests.
        streams: the per-gateway step streams the deltas go out on.
    """

    def __init__(self, admissions: Admissions, streams: GatewayStreams) -> None:
        self.admissions = admissions
        self.streams = streams
        self.step = 0  # written by the engine thread only
        self._builder = DeltaBuilder()
        self._rate = TokenRate()
        self._loop: asyncio.AbstractEventLoop | None = None

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """Deliver steps on `loop` (the one the gRPC server runs on)."""
        self._loop = loop

    def tokens_per_second(self) -> float:
        return self._rate.per_second()

    def end_request(self, gateway_id: str, delta: RequestDelta) -> None:
        """Send a request's last delta now, outside any engine step (it ended before the
        engine had it)."""
        self._builder.forget(delta.request_id)
        self.streams.publish(gateway_id, [delta], self.step)

    def on_step(self, outputs: list[RequestOutput]) -> None:
        """Engine thread: hand the whole step to the event loop in one callback (none for a
        step without news, e.g. one whose tokens the engine's stream interval holds)."""
        self.step += 1
        if outputs and self._loop is not None:
            try:
                self._loop.call_soon_threadsafe(self._publish, self.step, outputs)
            except RuntimeError:  # the loop closed during shutdown
                pass

    def _publish(self, step: int, outputs: list[RequestOutput]) -> None:
        by_gateway: dict[str, list[RequestDelta]] = {}
        num_tokens = 0
        for output in outputs:
            request = self.admissions.held(output.request_id)
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
                self.admissions.finish(output.request_id)
            num_tokens += sum(len(delta.token_ids) for delta in deltas)
            by_gateway.setdefault(request.gateway_id, []).extend(deltas)
        self._rate.add(num_tokens)
        for gateway_id, deltas in by_gateway.items():
            self.streams.publish(gateway_id, deltas, step)
        self.admissions.wake()  # the step may have freed blocks (finished or preempted requests)
