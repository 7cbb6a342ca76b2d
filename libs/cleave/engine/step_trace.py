"""`StepTrace`: the engine hops of traced requests, timed on the step thread.

For each request submitted inside a traced request (`cleave.tracing.current_context()` not
None at `AsyncEngine.submit`) it records two spans into the submitter's trace:

    engine.queue_wait       arrival (submit) -> start of the first step that schedules it
    engine.prefill_forward  that step's start -> end of the step that reports its first
                            output (its prompt computed and first token sampled; with
                            chunked prefill several steps, overlapped: the step resolving it)

A request counts as scheduled once its first sequence has computed tokens (a prefix-cache
hit or a run chunk). Untraced requests are never watched; with none watched the step loop
pays one dict truth test per step.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from opentelemetry.context import Context

from cleave.engine.request import RequestState
from cleave.generation.outputs import RequestOutput
from cleave.tracing import current_context, record_span


@dataclass(frozen=True)
class TraceOrigin:
    """Where a request entered the engine: its caller's trace context and the time."""

    context: Context
    arrival_ns: int

    @staticmethod
    def capture() -> "TraceOrigin | None":
        """The caller's origin when it runs inside a traced request, else None."""
        context = current_context()
        return None if context is None else TraceOrigin(context, time.time_ns())


@dataclass
class _Watched:
    state: RequestState
    origin: TraceOrigin
    first_step_ns: int | None = None


class StepTrace:
    """Times queue wait and prefill of watched requests around `LLMEngine.step` (step
    thread only)."""

    def __init__(self) -> None:
        self.watched: dict[str, _Watched] = {}

    def watch(self, state: RequestState, origin: TraceOrigin) -> None:
        """Follow a request just queued in the engine."""
        self.watched[state.request_id] = _Watched(state, origin)

    def step(self, run_step: Callable[[], list[RequestOutput]]) -> list[RequestOutput]:
        """Run one engine step and record the spans of watched requests it advanced."""
        start_ns = time.time_ns()
        outputs = run_step()
        end_ns = time.time_ns()
        reported = {output.request_id for output in outputs}
        for request_id, watched in list(self.watched.items()):
            if watched.first_step_ns is None and watched.state.samples[0].seq.num_computed_tokens > 0:
                watched.first_step_ns = start_ns
                record_span("engine.queue_wait", watched.origin.arrival_ns, start_ns, watched.origin.context,
                            request_id=request_id)
            if request_id not in reported:
                continue
            del self.watched[request_id]
            if watched.first_step_ns is not None:  # else it ended (aborted) before running
                seq = watched.state.samples[0].seq
                record_span("engine.prefill_forward", watched.first_step_ns, end_ns, watched.origin.context,
                            request_id=request_id, prompt_tokens=seq.num_prompt_tokens)
        return outputs
