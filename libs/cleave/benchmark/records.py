"""`RequestRecord`: what one request measured, the unit every later stage reads."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class RequestRecord:
    """One request's timings and outcome; times are seconds on the benchmark's monotonic clock.

    `sent_s` is the offset from the run's start at which the request went out; `ttft_s` and
    `e2e_s` are from that moment. `itl_s` holds the gaps between consecutive streamed chunks
    with choices (a chunk holding several tokens is one gap, as in vLLM's benchmark).
    `output_tokens` is the server's `usage.completion_tokens` when it sent usage
    (`usage_reported`), else the number of such chunks. A failed request has
    `error` (one line) and `error_reason` (what the error table groups by: `HTTP 503`,
    `timeout`, `connection`, `stream error`, `protocol`).
    """

    index: int
    sent_s: float
    prompt_len: int | None
    output_len: int  # asked for
    success: bool = False
    ttft_s: float | None = None
    e2e_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    output_tokens: int = 0
    usage_reported: bool = False
    finish_reason: str | None = None
    status: int | None = None
    error: str | None = None
    error_reason: str | None = None

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first: (e2e - ttft) / (output_tokens - 1); None
        for one token or fewer, where it is undefined."""
        if not self.success or self.ttft_s is None or self.e2e_s is None or self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)

    def token_times_s(self) -> list[float]:
        """When each chunk with a choice arrived, as offsets from the run's start."""
        if self.ttft_s is None:
            return []
        times = [self.sent_s + self.ttft_s]
        for gap in self.itl_s:
            times.append(times[-1] + gap)
        return times

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "tpot_s": self.tpot_s}
