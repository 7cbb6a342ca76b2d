"""What the workers' engines did over a bench's measured window, read from their /metrics.

A served TPOT is the decode engine's step time plus whatever keeps the step loop from
starting its next step (tokens waiting to be streamed, the event loop, the GIL). `EngineMeter`
scrapes each worker's `cleave:engine_step_seconds` and `cleave:iteration_tokens_total`
histograms at the start and at the end of the window and reports, per worker group:

    <role>_step_ms     mean wall time of an engine step that ran the model
    <role>_steps_s     such steps per second of the window
    <role>_busy_pct    share of the window spent inside those steps
    <role>_tokens      mean tokens per step (the decode batch, or the prefill chunk)

When `decode_step_ms` is close to the served TPOT the engine's step is what a user waits
for; when `decode_busy_pct` is far under 100 the loop waits between steps.

    meter = EngineMeter({"decode": ["127.0.0.1:9101"], "prefill": ["127.0.0.1:9102"]})
    ...                                     # the measured window
    meter.columns(wall_s)                   # {"decode_step_ms": 1.9, "decode_steps_s": 420.0, ...}
"""

from __future__ import annotations

import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

STEP_SECONDS = "cleave:engine_step_seconds"
STEP_TOKENS = "cleave:iteration_tokens_total"


@dataclass(frozen=True)
class StepTotals:
    """Sums over a worker group's engines: steps, their seconds and their tokens."""

    steps: float = 0.0
    seconds: float = 0.0
    tokens: float = 0.0

    def __add__(self, other: StepTotals) -> StepTotals:
        return StepTotals(self.steps + other.steps, self.seconds + other.seconds, self.tokens + other.tokens)

    def __sub__(self, other: StepTotals) -> StepTotals:
        return StepTotals(self.steps - other.steps, self.seconds - other.seconds, self.tokens - other.tokens)


def parse_totals(text: str) -> StepTotals:
    """The step histograms' count and sums in one /metrics page (zeros where absent)."""
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in (f"{STEP_SECONDS}_count", f"{STEP_SECONDS}_sum", f"{STEP_TOKENS}_sum"):
                values[sample.name] = values.get(sample.name, 0.0) + sample.value
    return StepTotals(values.get(f"{STEP_SECONDS}_count", 0.0), values.get(f"{STEP_SECONDS}_sum", 0.0),
                      values.get(f"{STEP_TOKENS}_sum", 0.0))


def scrape_totals(address: str, timeout_s: float = 10.0) -> StepTotals:
    """One worker's totals from http://<address>/metrics (zeros when it does not answer)."""
    try:
        with urllib.request.urlopen(f"http://{address}/metrics", timeout=timeout_s) as response:
            return parse_totals(response.read().decode())
    except OSError:
        return StepTotals()


def step_columns(role: str, totals: StepTotals, wall_s: float) -> dict[str, float]:
    """The four columns of one group over a window of `wall_s` seconds."""
    steps = max(totals.steps, 1e-9)
    return {f"{role}_step_ms": round(1e3 * totals.seconds / steps, 2),
            f"{role}_steps_s": round(totals.steps / max(wall_s, 1e-9), 1),
            f"{role}_busy_pct": round(100 * totals.seconds / max(wall_s, 1e-9), 1),
            f"{role}_tokens": round(totals.tokens / steps, 1)}


class EngineMeter:
    """Engine steps of named worker groups from now on (see the module docstring).

    Args:
        groups: role -> the metrics addresses (host:port) of its workers.
    """

    def __init__(self, groups: Mapping[str, Sequence[str]]) -> None:
        self._groups = {role: list(addresses) for role, addresses in groups.items() if addresses}
        self._start = self._totals()

    def _totals(self) -> dict[str, StepTotals]:
        return {role: sum((scrape_totals(address) for address in addresses), StepTotals())
                for role, addresses in self._groups.items()}

    def columns(self, wall_s: float) -> dict[str, float]:
        """Every group's columns since the meter started."""
        end = self._totals()
        columns: dict[str, float] = {}
        for role in sorted(end):
            columns.update(step_columns(role, end[role] - self._start[role], wall_s))
        return columns
