"""bench/engine_meter.py: an engine's steps over a window, from the worker's /metrics page."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from cleave.metrics.engine import EngineMetrics
from cleave.metrics.labels import MetricLabels

# Loaded by path, bench/ not put on sys.path: the bench scripts' bare module names
# (`common`, `engine`) stay out of later tests of this process.
_spec = importlib.util.spec_from_file_location("bench_engine_meter", Path(__file__).resolve().parents[2] / "bench" / "engine_meter.py")
engine_meter = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = engine_meter  # its dataclasses look their module up there
_spec.loader.exec_module(engine_meter)  # type: ignore[union-attr]


def page(steps: list[tuple[float, int]]) -> str:
    """The /metrics text of a worker whose engine ran `steps` ((wall_s, tokens) each)."""
    registry = CollectorRegistry()
    metrics = EngineMetrics(registry, MetricLabels(model_name="m", worker_id="decode-0"))
    for wall_s, tokens in steps:
        metrics.observe_step(SimpleNamespace(wall_s=wall_s, num_tokens=tokens, used_graph=True))
    return generate_latest(registry).decode()


def test_totals_come_from_the_engines_step_histograms():
    totals = engine_meter.parse_totals(page([(0.002, 48), (0.004, 50), (0.0, 0)]))  # a step of no tokens is not one
    assert totals.steps == 2 and totals.seconds == pytest.approx(0.006) and totals.tokens == 98


def test_columns_over_a_window_are_the_difference_of_two_scrapes():
    before = engine_meter.parse_totals(page([(0.010, 8)]))
    after = engine_meter.parse_totals(page([(0.010, 8), (0.002, 48), (0.004, 50)]))
    columns = engine_meter.step_columns("decode", after - before, wall_s=0.012)
    assert columns == {"decode_step_ms": 3.0, "decode_steps_s": 166.7, "decode_busy_pct": 50.0, "decode_tokens": 49.0}


def test_a_worker_that_does_not_answer_reads_as_no_steps():
    assert engine_meter.scrape_totals("127.0.0.1:1", timeout_s=2) == engine_meter.StepTotals()
