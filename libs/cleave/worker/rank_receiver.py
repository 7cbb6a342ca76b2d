"""A follower rank's KV receiver: the bulk endpoint over its cache that a prefill worker
sends this rank's slice of the KV heads to, run for the leader over a control pipe.

The follower's main thread runs the engine in lockstep (`cleave.engine.lockstep.follow`) and
reads the lockstep pipe only at step boundaries; this endpoint lives beside it, in a thread
with an event loop of its own, so a transfer is registered and lands while the engine steps
or idles. It writes only into blocks the leader reserved (see
`cleave.transfer.rank_receivers` for why a follower may do so before it applied Reserve).
Messages: `cleave.transfer.rank_messages`. Transfers are TCP (CPU-tested); on CUDA the
landing runs on this thread's current stream, untested.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from multiprocessing.connection import Connection

import structlog
import torch

from cleave.errors import CleaveError
from cleave.rpc.types import KVLayout, TransportKind
from cleave.transfer.rank_messages import (
    Cancel,
    Done,
    Expect,
    Failed,
    Listen,
    ListenFailed,
    Listening,
    Registered,
    RegistrationFailed,
    ToFollower,
    ToLeader,
)
from cleave.transfer.receiver import KVReceiver, PendingTransfer

log = structlog.get_logger("cleave.worker")
STOP_WAIT_S = 10.0


class FollowerReceiver:
    """Rank `rank`'s bulk KV endpoint, served for the leader over `connection` (see the
    module docstring). `start()` returns at once; `stop()` ends the thread.

    Args:
        rank: this process's rank (for logs).
        kv_cache: the rank's KV cache [L, 2, NB, BS, Hkv, D].
        connection: this rank's end of its control pipe to the leader.
        layout_of: the cache's KVLayout for a model id (its heads named).
    """

    def __init__(self, rank: int, kv_cache: torch.Tensor, connection: Connection,
                 layout_of: Callable[[str], KVLayout]) -> None:
        self.rank = rank
        self.kv_cache = kv_cache
        self._connection = connection
        self._layout_of = layout_of
        self._receiver: KVReceiver | None = None
        self._pending: dict[str, PendingTransfer] = {}
        self._tasks: set[asyncio.Task] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping: asyncio.Event | None = None
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"cleave-rank{rank}-kv", daemon=True)

    def start(self) -> None:
        self._thread.start()
        self._ready.wait()

    def stop(self) -> None:
        """Close the endpoint (pending transfers fail) and end the thread."""
        if self._loop is not None and self._stopping is not None and not self._loop.is_closed():
            try:
                self._loop.call_soon_threadsafe(self._stopping.set)
            except RuntimeError:  # the loop already ended
                pass
        self._thread.join(STOP_WAIT_S)

    # -- the thread -------------------------------------------------------------------------

    def _run(self) -> None:
        asyncio.run(self._serve())

    async def _serve(self) -> None:
        self._loop = loop = asyncio.get_running_loop()
        self._stopping = asyncio.Event()
        loop.add_reader(self._connection.fileno(), self._readable)
        self._ready.set()
        try:
            await self._stopping.wait()
        finally:
            loop.remove_reader(self._connection.fileno())
            if self._receiver is not None:
                await self._receiver.close()
            for task in list(self._tasks):
                task.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)

    def _readable(self) -> None:
        assert self._stopping is not None
        try:
            while self._connection.poll():
                self._on_message(self._connection.recv())
        except (EOFError, OSError):  # the leader is gone: its process ends this one too
            self._stopping.set()

    def _send(self, message: ToLeader) -> None:
        try:
            self._connection.send(message)
        except OSError:
            pass  # the leader is gone

    def _spawn(self, awaitable) -> None:
        task = asyncio.ensure_future(awaitable)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _on_message(self, message: ToFollower) -> None:
        if isinstance(message, Listen):
            self._spawn(self._listen(message))
        elif isinstance(message, Expect):
            self._expect(message)
        elif isinstance(message, Cancel):
            pending = self._pending.get(message.transfer_id)
            if pending is not None:
                pending.cancel(message.reason)

    async def _listen(self, message: Listen) -> None:
        try:
            layout = self._layout_of(message.model_id)
            receiver = KVReceiver(self.kv_cache, host=message.host, port=0, advertise_host=message.advertise_host,
                                  layout=layout, internal_token=message.internal_token, tls=message.tls)
            await receiver.start()
        except (CleaveError, OSError) as error:
            self._send(ListenFailed(str(error)))
            return
        self._receiver = receiver
        log.info("tensor-parallel rank KV receiver listening", rank=self.rank, address=receiver.address,
                 kv_heads=f"{layout.kv_head_start}..{layout.kv_head_start + layout.num_kv_heads - 1}")
        self._send(Listening(receiver.address, layout))

    def _expect(self, message: Expect) -> None:
        try:
            if self._receiver is None:
                raise CleaveError(f"rank {self.rank}'s KV receiver is not listening")
            pending = self._receiver.expect(
                message.transfer_id, message.block_ids, num_cached_blocks=message.num_cached_blocks,
                deadline_unix_s=message.deadline_unix_s, transport=TransportKind.TCP, worker_id=message.worker_id)
        except CleaveError as error:
            self._send(RegistrationFailed(message.transfer_id, error))
            return
        self._pending[message.transfer_id] = pending
        self._send(Registered(message.transfer_id, pending.handle))
        self._spawn(self._report(pending))

    async def _report(self, pending: PendingTransfer) -> None:
        try:
            stats = await pending.wait()
        except CleaveError as error:
            self._send(Failed(pending.transfer_id, error))
        else:
            self._send(Done(pending.transfer_id, stats))
        finally:
            self._pending.pop(pending.transfer_id, None)
