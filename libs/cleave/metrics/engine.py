"""An engine's series (prefill and decode workers), read at scrape time.

What the step loop already counts (`SchedulerStats`: tokens, prefix-cache queries and hits,
preemptions), its queues and its KV usage are read when Prometheus scrapes, from the
metrics thread: the step loop pays nothing for them. Per step it pays one call of
`observe_step` (set as `LLMEngine.step_observer`): two `StepHistogram` samples and one
integer increment, no lock, whatever the batch size.

    cleave:num_sequences_running / _waiting   scheduler queues (gauges)
    cleave:num_preemptions_total
    cleave:kv_cache_usage_perc                 share of usable KV blocks held (0..1)
    cleave:prefix_cache_queries_total / _hits_total   tokens looked up / found cached
    cleave:prompt_tokens_total                 prompt (and recomputed) tokens computed
    cleave:generation_tokens_total             decode tokens computed
    cleave:engine_steps_total{runner}          cuda_graph replays vs eager forwards
    cleave:engine_step_seconds                 wall time of one step (histogram)
    cleave:iteration_tokens_total              tokens per step (histogram, vLLM's name)
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from cleave.metrics.labels import PREFIX, STEP_SECONDS_BUCKETS, TOKEN_BUCKETS, MetricLabels
from cleave.metrics.step_histogram import StepHistogram

if TYPE_CHECKING:
    from cleave.engine.llm_engine import LLMEngine
    from cleave.engine.model_runner import StepStats


class EngineMetrics:
    """A Prometheus collector over one `LLMEngine` (none until `bind`: the series are empty
    while the model loads).

    Args:
        registry: the process's registry; this collector registers itself there.
        labels: model_name and worker_id.
    """

    def __init__(self, registry: CollectorRegistry, labels: MetricLabels) -> None:
        self._names = list(MetricLabels.NAMES)
        self._values = list(labels.values)
        self._engine: LLMEngine | None = None
        self.step_seconds = StepHistogram(STEP_SECONDS_BUCKETS)
        self.step_tokens = StepHistogram(TOKEN_BUCKETS)
        self.num_graph_steps = 0
        self.num_eager_steps = 0
        registry.register(self)

    def bind(self, engine: LLMEngine) -> None:
        """Read this engine from now on and hear each of its steps."""
        self._engine = engine
        engine.step_observer = self.observe_step

    def observe_step(self, stats: StepStats) -> None:
        """Step thread, after every step: time and tokens of a step that ran the model."""
        if not stats.num_tokens:
            return
        self.step_seconds.observe(stats.wall_s)
        self.step_tokens.observe(stats.num_tokens)
        if stats.used_graph:
            self.num_graph_steps += 1
        else:
            self.num_eager_steps += 1

    def collect(self) -> Iterator[Metric]:
        engine, names, values = self._engine, self._names, self._values

        def gauge(name: str, doc: str, value: float | None) -> GaugeMetricFamily:
            family = GaugeMetricFamily(f"{PREFIX}{name}", doc, labels=names)
            if value is not None:
                family.add_metric(values, value)
            return family

        def counter(name: str, doc: str, value: float | None) -> CounterMetricFamily:
            family = CounterMetricFamily(f"{PREFIX}{name}", doc, labels=names)
            if value is not None:
                family.add_metric(values, value)
            return family

        scheduler = engine.scheduler if engine is not None else None
        stats = scheduler.stats if scheduler is not None else None
        yield gauge("num_sequences_running", "Sequences holding KV blocks in the engine",
                    scheduler.num_running if scheduler else None)
        # the queues' lengths, not `num_waiting`: that walks a dict the step thread may be resizing
        yield gauge("num_sequences_waiting", "Sequences waiting to be (re)admitted, or with their KV received, "
                    "for a seat", scheduler.num_waiting_for_seat if scheduler else None)
        yield gauge("kv_cache_usage_perc", "Share of usable KV blocks held by sequences (0..1; cached free "
                    "blocks count as free)", engine.kv.usage if engine else None)
        yield gauge("kv_cache_num_blocks", "Usable KV blocks", engine.kv.num_usable_blocks if engine else None)
        yield counter("num_preemptions", "Sequences preempted for KV blocks", stats.num_preemptions if stats else None)
        yield counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
                      stats.num_prefix_cache_query_tokens if stats else None)
        yield counter("prefix_cache_hits", "Prompt tokens found in the prefix cache",
                      stats.num_prefix_cache_hit_tokens if stats else None)
        yield counter("prompt_tokens", "Prompt (and recomputed) tokens run through the model",
                      stats.num_prefill_tokens if stats else None)
        yield counter("generation_tokens", "Decode tokens run through the model",
                      stats.num_decode_tokens if stats else None)
        steps = CounterMetricFamily(f"{PREFIX}engine_steps", "Engine steps that ran the model, by runner: a "
                                    "captured CUDA graph replay or an eager forward", labels=[*names, "runner"])
        if engine is not None:
            steps.add_metric([*values, "cuda_graph"], self.num_graph_steps)
            steps.add_metric([*values, "eager"], self.num_eager_steps)
        yield steps
        labels = dict(zip(names, values))
        yield self.step_seconds.family(f"{PREFIX}engine_step_seconds", "Wall time of one engine step", labels)
        yield self.step_tokens.family(f"{PREFIX}iteration_tokens_total", "Tokens per engine step", labels)


class BindEngineAfterStart:
    """A worker's lifecycle whose engine, once `start()` loaded it, is bound to `metrics`.

    Args:
        lifecycle: the worker's own lifecycle (start loads the engine).
        engine_of: the loaded engine (None: no engine, nothing bound).
        metrics: the engine series to bind.
    """

    def __init__(self, lifecycle, engine_of, metrics: EngineMetrics) -> None:  # type: ignore[no-untyped-def]
        self._lifecycle = lifecycle
        self._engine_of = engine_of
        self._metrics = metrics

    async def start(self) -> None:
        await self._lifecycle.start()
        engine = self._engine_of()
        if engine is not None:
            self._metrics.bind(engine)

    async def shutdown(self) -> None:
        await self._lifecycle.shutdown()
