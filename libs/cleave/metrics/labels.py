"""The labels every cleave series carries, and the bucket layouts shared by the histograms.

Every metric has `model_name` (the served model id) and `worker_id` (the gateway id, the
worker id, or "kvstore"), as vLLM's series carry `model_name`: one Prometheus holding many
processes tells them apart without relabelling.
"""

from __future__ import annotations

from dataclasses import dataclass

PREFIX = "cleave:"


@dataclass(frozen=True)
class MetricLabels:
    """The constant labels of one process's series."""

    model_name: str
    worker_id: str

    NAMES = ("model_name", "worker_id")

    @property
    def values(self) -> tuple[str, str]:
        return (self.model_name, self.worker_id)

    def as_dict(self) -> dict[str, str]:
        return dict(zip(self.NAMES, self.values))


def one_two_five_buckets(maximum: int) -> list[float]:
    """1, 2, 5, 10, 20, 50, ... up to `maximum` (vLLM's token-count buckets)."""
    buckets: list[float] = []
    exponent = 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10**exponent
            if value > maximum:
                return buckets
            buckets.append(float(value))
        exponent += 1


# Seconds. TTFT and end-to-end as vLLM's, with finer steps below 1 ms for per-token times
# (a decode step on the GPU is ~1-5 ms).
TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
PER_TOKEN_BUCKETS = [0.0005, 0.001, 0.0025, 0.005, 0.0075, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4,
                     0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0]
REQUEST_SECONDS_BUCKETS = [0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                           50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]
STEP_SECONDS_BUCKETS = [0.0005, 0.001, 0.002, 0.004, 0.008, 0.016, 0.032, 0.064, 0.128, 0.256, 0.512, 1.024,
                        2.048, 4.096]
RPC_SECONDS_BUCKETS = [0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
                       30.0, 60.0, 300.0]
TOKEN_BUCKETS = one_two_five_buckets(1 << 20)
