"""A prefill or decode worker's metrics, from its typed config: off without `--metrics-port`."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from cleave.config import WorkerConfig
from cleave.metrics.engine import BindEngineAfterStart, EngineMetrics
from cleave.metrics.labels import MetricLabels
from cleave.metrics.service import ServiceMetrics

if TYPE_CHECKING:
    from cleave.engine.llm_engine import LLMEngine


def worker_metrics(
    config: WorkerConfig, lifecycle: Any, engine_of: Callable[[], LLMEngine | None]
) -> tuple[Any, ServiceMetrics | None]:
    """The worker's lifecycle and metrics: with `--metrics-port`, the engine series are bound
    to the engine `engine_of()` once `lifecycle.start()` loaded it; without, the lifecycle
    is returned unchanged and no step pays for metrics."""
    if config.service.metrics is None:
        return lifecycle, None
    metrics = ServiceMetrics(MetricLabels(config.model.id, config.worker_id), config.service.metrics)
    engine = EngineMetrics(metrics.registry, metrics.labels)
    return BindEngineAfterStart(lifecycle, engine_of, engine), metrics
