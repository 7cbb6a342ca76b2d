"""A worker whose engine fails ends, for its supervisor to restart: both workers' backends
report the engine's error (`failed()`), and `run_service(fatal=...)` then drains, shuts the
backend down and exits with code 1, where a signal's stop exits as before."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from cleave.config import ServiceConfig
from cleave.errors import Unavailable
from cleave.generation.sampling_params import SamplingParams
from cleave.rpc import run_service
from tests.worker.cluster import start_decode, start_prefill


def broken_step():  # type: ignore[no-untyped-def]
    raise RuntimeError("device lost")


@pytest.mark.parametrize("start", [start_decode, start_prefill], ids=["decode", "prefill"])
async def test_a_workers_engine_failure_is_reported_to_its_service(checkpoint, start):
    worker = await start(checkpoint)
    try:
        backend = worker.backend
        failed = asyncio.ensure_future(backend.failed())
        backend.engine.step = broken_step
        with pytest.raises(Unavailable, match="device lost"):
            async for _ in backend.async_engine.submit("r", [1, 2, 3], SamplingParams(max_tokens=2)):
                pass
        error = await asyncio.wait_for(failed, 10)
        assert str(error) == "device lost"
    finally:
        await worker.close()


class Backend:
    """A service backend that records its lifecycle."""

    def __init__(self) -> None:
        self.events: list[str] = []
        self.started = asyncio.Event()

    async def start(self) -> None:
        self.events.append("start")
        self.started.set()

    async def shutdown(self) -> None:
        self.events.append("shutdown")


def test_a_fatal_error_drains_shuts_down_and_exits_1(tmp_path: Path):
    """As a worker's `main` runs it: SystemExit(1) leaves `asyncio.run` (the process's exit)."""
    backend = Backend()

    async def scenario() -> None:
        failure: asyncio.Future[BaseException] = asyncio.get_running_loop().create_future()

        async def fatal() -> BaseException:
            return await failure

        config = ServiceConfig(name="worker", listen="127.0.0.1:0", port_file=tmp_path / "port")
        running = asyncio.ensure_future(run_service([], config, backend, fatal=fatal))
        await asyncio.wait_for(backend.started.wait(), 10)
        failure.set_result(RuntimeError("device lost"))
        await asyncio.wait_for(running, 10)

    with pytest.raises(SystemExit) as raised:
        asyncio.run(scenario())
    assert raised.value.code == 1
    assert backend.events == ["start", "shutdown"]
