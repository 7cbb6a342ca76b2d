"""When each request is sent: offsets in seconds from the start of the run.

An infinite rate sends every request at once (then only `--max-concurrency` paces them).
A finite rate draws the gaps between requests from a gamma distribution with shape
`burstiness` and mean 1/rate, as vLLM's and SGLang's benchmarks do: burstiness 1 is a
Poisson process (exponential gaps), below 1 the arrivals come in bursts with long quiet
spells, above 1 they are more evenly spaced, and the mean rate stays the same.
"""

from __future__ import annotations

import math
import random


def arrival_offsets(num_requests: int, request_rate: float, burstiness: float = 1.0,
                    seed: int = 0) -> list[float]:
    """`num_requests` non-decreasing offsets (s); the first request goes at 0.

    Raises:
        ValueError: a rate or burstiness that is not positive.
    """
    if not request_rate > 0:
        raise ValueError(f"request rate must be positive (inf: all at once), got {request_rate}")
    if not burstiness > 0:
        raise ValueError(f"burstiness must be positive, got {burstiness}")
    if math.isinf(request_rate):
        return [0.0] * num_requests
    rng = random.Random(seed)
    scale = 1.0 / (request_rate * burstiness)  # mean gap = shape * scale = 1 / rate
    offsets, now = [], 0.0
    for _ in range(num_requests):
        offsets.append(now)
        now += rng.gammavariate(burstiness, scale)
    return offsets
