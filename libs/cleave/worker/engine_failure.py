"""A worker's engine failing, handed from the step thread to the event loop.

When a step raises, `AsyncEngine` fails every stream and runs nothing more: the worker
would stay up, out of every gateway's rotation, until someone restarted it by hand. So the
worker's service ends instead (`run_service(fatal=...)`: drain, shut down, exit code 1) and
its supervisor (`cleave up`, a container's restart policy) starts a fresh one, whose
peers find it on the same address; the gateway meanwhile moves the failed streams.

    failure = EngineFailure()
    failure.bind()                                   # on the loop, before the engine starts
    AsyncEngine(engine, on_failure=failure.report)   # the step thread reports
    error = await failure.wait()                     # the service's fatal()
"""

from __future__ import annotations

import asyncio


class EngineFailure:
    """The first error of a worker's engine, awaitable on the worker's event loop."""

    def __init__(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        self._failed: asyncio.Future[BaseException] | None = None

    def bind(self) -> None:
        """Attach to the running loop (call on it before the engine can fail)."""
        self._loop = asyncio.get_running_loop()
        self._failed = self._loop.create_future()

    def report(self, error: BaseException) -> None:
        """The engine failed with `error` (any thread; the first report counts)."""
        loop, failed = self._loop, self._failed
        if loop is None or failed is None:
            return

        def settle() -> None:
            if not failed.done():
                failed.set_result(error)

        try:
            loop.call_soon_threadsafe(settle)
        except RuntimeError:  # the loop closed: the process is ending anyway
            pass

    async def wait(self) -> BaseException:
        """The engine's error, once it failed (after `bind`)."""
        if self._failed is None:
            raise RuntimeError("bind() the engine failure to the loop first")
        return await asyncio.shield(self._failed)
