"""Worker start-up freezes the model's and engine's objects out of the collector's walks."""

from __future__ import annotations

import gc
from typing import Any

import pytest
from structlog.testing import capture_logs

from cleave.worker import FreezeAfterStart
from services.decode.engine_backend import EngineDecodeBackend
from tests.worker.cluster import MODEL_ID, engine_config


@pytest.fixture
def unfrozen():
    """Starts and ends with an empty permanent generation, so no other test is affected."""
    gc.unfreeze()
    yield
    gc.unfreeze()


def _is_collector_tracked(target: object) -> bool:
    """Whether `target` is in one of the collected generations (frozen objects are not)."""
    return any(obj is target for obj in gc.get_objects())


async def test_started_worker_has_its_engine_frozen(checkpoint, unfrozen):
    backend = EngineDecodeBackend(engine_config(checkpoint), worker_id="decode-gc", model_id=MODEL_ID)
    lifecycle = FreezeAfterStart(backend, "decode-gc")
    assert gc.get_freeze_count() == 0
    with capture_logs() as logs:
        await lifecycle.start()
    try:
        frozen = gc.get_freeze_count()
        assert frozen > 0
        assert backend.engine is not None and gc.is_tracked(backend.engine)
        assert not _is_collector_tracked(backend.engine)
        assert not _is_collector_tracked(backend.engine.kv)
        [event] = [log for log in logs if log["event"] == "gc_frozen"]
        # Frozen objects freed by reference counting since leave the count.
        assert event["objects_frozen"] >= frozen and event["worker_id"] == "decode-gc"
    finally:
        await lifecycle.shutdown()
    assert backend.async_engine is not None and not backend.async_engine.is_running


@pytest.mark.parametrize("service", ["prefill", "decode"])
def test_worker_entry_points_start_through_freeze_after_start(service, checkpoint, monkeypatch):
    module = __import__(f"services.{service}.__main__", fromlist=["main"])
    started: list[Any] = []

    async def fake_run_service(services, config, backend, **kwargs) -> None:
        started.append(backend)

    monkeypatch.setattr(module, "run_service", fake_run_service)
    monkeypatch.setattr(module, "configure_logging", lambda *args: None)
    assert module.main(["--model", str(checkpoint), "--device", "cpu", "--worker-id", f"{service}-9"]) == 0
    [lifecycle] = started
    assert isinstance(lifecycle, FreezeAfterStart)
    assert lifecycle.worker_id == f"{service}-9"
    assert type(lifecycle.backend).__name__ == f"Engine{service.capitalize()}Backend"


def test_the_prefill_entry_point_passes_layer_streaming(checkpoint, monkeypatch):
    module = __import__("services.prefill.__main__", fromlist=["main"])
    started: list[Any] = []

    async def fake_run_service(services, config, backend, **kwargs) -> None:
        started.append(backend)

    monkeypatch.setattr(module, "run_service", fake_run_service)
    monkeypatch.setattr(module, "configure_logging", lambda *args: None)
    assert module.main(["--model", str(checkpoint), "--device", "cpu", "--layer-streaming", "off"]) == 0
    [lifecycle] = started
    assert lifecycle.backend.layer_streaming == "off"
