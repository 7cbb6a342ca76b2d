"""Sends the requests on their arrival offsets under an optional concurrency cap.

Each request becomes a task at its offset; with `max_concurrency` it then waits for one of
that many slots, so a rate above what the server sustains queues in the benchmark, as
vLLM's `--max-concurrency` does. The run's duration is from the start until the last request
ended (answered or failed); throughput and goodput divide by it.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from cleave.benchmark.client import OpenAIClient
from cleave.benchmark.records import RequestRecord
from cleave.benchmark.workload import BenchRequest


@dataclass(frozen=True)
class LoadSpec:
    """How to send: offsets (s, one per request) and the in-flight cap (None: no cap)."""

    offsets_s: Sequence[float]
    max_concurrency: int | None = None


@dataclass(frozen=True)
class RunResult:
    """The records of one run (in request order) and its wall time."""

    records: list[RequestRecord]
    duration_s: float


async def run_load(client: OpenAIClient, requests: Sequence[BenchRequest], load: LoadSpec,
                   on_done: Callable[[RequestRecord], None] | None = None) -> RunResult:
    """Send every request and wait for all of them; `on_done` sees each record as it ends."""
    if len(load.offsets_s) != len(requests):
        raise ValueError(f"{len(load.offsets_s)} offsets for {len(requests)} requests")
    slots = asyncio.Semaphore(load.max_concurrency) if load.max_concurrency else None
    start = time.perf_counter()

    async def one(index: int, request: BenchRequest) -> RequestRecord:
        if slots is None:
            record = await client.send(request, index, start)
        else:
            async with slots:
                record = await client.send(request, index, start)
        if on_done is not None:
            on_done(record)
        return record

    tasks = []
    for index, (request, offset) in enumerate(zip(requests, load.offsets_s)):
        delay = offset - (time.perf_counter() - start)
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(index, request)))
    try:
        records = list(await asyncio.gather(*tasks))
    finally:
        for task in tasks:
            task.cancel()
    return RunResult(records, max(time.perf_counter() - start, math.ulp(1.0)))
