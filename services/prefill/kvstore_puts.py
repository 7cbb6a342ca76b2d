"""A prefill worker's background kvstore puts.

After a prompt's KV went to its decode worker, its new full blocks may go to the kvstore
(`KVStorePrefix.gather`, then `put`) without the response waiting. Each put owns its prompt's
blocks until they are copied to host memory, then frees them (`release`), on every path. The
host bytes of puts in flight are bounded: past `max_bytes` a prompt is not stored (a slow
store never backs up into prefill), and the skip is counted.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence

import grpc
import structlog

from cleave.errors import CleaveError
from services.prefill.kvstore_prefix import KVStorePrefix, PrefixFetch

log = structlog.get_logger("cleave.prefill")
# Host copies of prompt blocks on their way to the kvstore, at most. Puts are an optimisation:
# past this, a prompt's blocks are not stored, so a slow store never backs up into prefill
# (its lookups sit on every request's path and would queue behind a flood of puts).
STORE_BACKLOG_BYTES = 256 << 20


class BackgroundPuts:
    """The puts in flight, one per request id.

    Args:
        kvstore: the worker's use of the store.
        release: frees a request's prompt blocks (and kvstore hold) in the engine.
        max_bytes: host bytes of puts in flight at most.
        on_stored / on_skipped: counters (blocks the store newly kept; prompts not stored).
    """

    def __init__(self, kvstore: KVStorePrefix, release: Callable[[str], Awaitable[None]], max_bytes: int,
                 on_stored: Callable[[int], None], on_skipped: Callable[[], None]) -> None:
        self.kvstore = kvstore
        self.max_bytes = max_bytes
        self._release = release
        self._on_stored = on_stored
        self._on_skipped = on_skipped
        self._tasks: dict[str, asyncio.Task[None]] = {}  # request id -> its put
        self._backlog = 0  # host bytes of the puts in `_tasks`

    def get(self, request_id: str) -> asyncio.Task[None] | None:
        """The request's put still running (its blocks are still held), if any."""
        return self._tasks.get(request_id)

    def start(self, request_id: str, prompt: Sequence[int], table: list[int], fetch: PrefixFetch) -> bool:
        """Start the put (it then owns the prompt's blocks) unless the backlog is full."""
        num_bytes = len(table) * self.kvstore.engine.kv_cache[:, :, 0].nbytes  # host bytes of its blocks
        if self._backlog + num_bytes > self.max_bytes:
            self._on_skipped()
            log.debug("kvstore put skipped: backlog full", request_id=request_id, backlog_bytes=self._backlog)
            return False
        self._backlog += num_bytes
        task = asyncio.create_task(self._put(request_id, prompt, table, fetch), name=f"kvstore-put-{request_id}")
        self._tasks[request_id] = task

        def forget(done: asyncio.Task[None]) -> None:
            self._backlog -= num_bytes
            if self._tasks.get(request_id) is done:
                del self._tasks[request_id]

        task.add_done_callback(forget)
        return True

    async def _put(self, request_id: str, prompt: Sequence[int], table: list[int], fetch: PrefixFetch) -> None:
        """Gather the prompt's new full blocks to host memory, free the prompt's KV, put the
        blocks in the kvstore. Never raises: a failed put only costs a later cache miss."""
        released = False
        try:
            payload = await self.kvstore.gather(request_id, prompt, table, fetch)
            await self._release(request_id)
            released = True
            if payload is not None:
                self._on_stored(await self.kvstore.put(payload))
        except (grpc.aio.AioRpcError, CleaveError) as error:
            log.warning("kvstore put failed", request_id=request_id, error=str(error))
        except Exception:
            log.exception("kvstore put failed", request_id=request_id)
        finally:
            if not released:
                await self._release(request_id)

    async def wait(self, timeout_s: float | None = None) -> bool:
        """Wait until the puts started so far are done (True), or `timeout_s` passed (False)."""
        pending = set(self._tasks.values())
        if not pending:
            return True
        _, still_running = await asyncio.wait(pending, timeout=timeout_s)
        return not still_running

    async def stop(self, timeout_s: float) -> None:
        """Let the puts run for `timeout_s`, then cancel the rest (each still frees its blocks)."""
        await self.wait(timeout_s)
        for task in list(self._tasks.values()):
            task.cancel()
        await asyncio.gather(*self._tasks.values(), return_exceptions=True)
