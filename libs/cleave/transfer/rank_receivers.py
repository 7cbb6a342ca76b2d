"""The KV receiver of a tensor-parallel decode worker: rank 0's own endpoint plus one per
follower rank, presented as one `KVReceiver`-like object (`RankReceivers`).

Every rank holds a slice of the model's KV heads in its own cache, under the same block ids
(the leader's reservations are mirrored on the followers: `cleave.engine.lockstep`). A
transfer into such a worker is one transfer per rank, each of that rank's heads:

    admission (rank 0's event loop)            follower r (`cleave.worker.rank_receiver`)
    RankReceivers.expect(id, block_ids)
      local KVReceiver.expect(...)              (rank 0's heads: the handle itself)
      Expect(id/rank<r>.<n>, ...)   -- pipe -->  KVReceiver.expect(...) -> Registered(handle)
    await transfer.registered()   <-- acks --   (Admit returns only once every rank expects it)
      -> handle + rank_handles (TCP, each with its rank's layout)
    await transfer.wait()         <-- Done ---  every layer of rank r's slice arrived
      done when every rank's part is; the first failure fails the whole transfer and
      cancels the other parts (Cancel to each follower still expecting)

The control pipes are read on the event loop (`loop.add_reader`), not at step boundaries:
an idle leader does not step, and Admit must not wait for one.

Why a follower may write into a reserved block before it applied the leader's `Reserve`:
the leader reserves between steps, from blocks free after its step k. A block freed at the
end of step k is no longer read by any follower's step k once the leader finished step k
(the step's collectives, the logits gather last, order every rank's forward before it), and
a follower's step k+1 runs only after it applied the ops published before it, Reserve
included, so no step of any rank reads the block while the transfer writes it.

Rank handles are TCP in this version; NCCL or CUDA IPC into the followers' caches (and
anything on several GPUs) is untested.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from multiprocessing.connection import Connection

import structlog

from cleave.errors import CleaveError, FailedPrecondition, NotFound, Unavailable
from cleave.rpc.types import KVLayout, TransferHandle, TransferStats, TransportKind
from cleave.tls import TlsConfig
from cleave.transfer.nccl import NcclCommunicator
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

log = structlog.get_logger("cleave.transfer")
LISTEN_TIMEOUT_S = 60.0  # a follower's endpoint starts in milliseconds; this only bounds a hang


@dataclass
class _RankLink:
    """The leader's end of one follower's control pipe and what it waits for on it."""

    rank: int
    connection: Connection
    address: str = ""
    layout: KVLayout | None = None
    listening: asyncio.Future[Listening] | None = None
    registrations: dict[str, asyncio.Future[TransferHandle]] = field(default_factory=dict)
    completions: dict[str, asyncio.Future[TransferStats]] = field(default_factory=dict)
    lost: CleaveError | None = None  # the follower's pipe ended: every later call fails with this

    def send(self, message: ToFollower) -> None:
        if self.lost is not None:
            raise self.lost
        self.connection.send(message)


class RankedTransfer:
    """One transfer into every rank of the worker: the interface of `PendingTransfer`
    (`handle`, `transfer_id`, `done`, `wait`, `cancel`, plus `registered`), completing only
    when every rank's part did.

    Args:
        local: rank 0's part (its `handle` is the transfer's handle).
        parts: for each follower, its link, its part's transfer id, the registration's
            future (its handle) and the completion's (its stats).
    """

    def __init__(self, local: PendingTransfer,
                 parts: Sequence[tuple[_RankLink, str, asyncio.Future[TransferHandle], asyncio.Future[TransferStats]]]
                 ) -> None:
        self._local = local
        self._parts = list(parts)
        self.handle = local.handle  # rank handles added once every follower registered
        self._result: asyncio.Task[TransferStats] = asyncio.ensure_future(self._complete())
        self._result.add_done_callback(_consume)

    @property
    def transfer_id(self) -> str:
        return self._local.transfer_id

    @property
    def done(self) -> bool:
        return self._result.done()

    async def registered(self) -> TransferHandle:
        """The handle naming every rank, once each follower expects its part; raises a
        follower's refusal (the caller cancels the transfer)."""
        handles = await asyncio.gather(*(registration for _, _, registration, _ in self._parts))
        self.handle = replace(self._local.handle, rank_handles=tuple(handles))
        return self.handle

    async def wait(self) -> TransferStats:
        """Stats (bytes of every rank) once every rank's part arrived; raises the first
        part's error (DeadlineExceeded, a refused chunk, a cancel, a lost rank)."""
        return await asyncio.shield(self._result)

    def cancel(self, reason: str = "cancelled by the receiver") -> None:
        """Drop every rank's registration; later chunks are refused on each."""
        self._local.cancel(reason)
        for link, transfer_id, _, completion in self._parts:
            if completion.done():
                continue
            completion.set_exception(NotFound(reason))
            try:
                link.send(Cancel(transfer_id, reason))
            except (CleaveError, OSError):  # the rank is gone: nothing of it to cancel
                pass

    async def _complete(self) -> TransferStats:
        local = asyncio.ensure_future(self._local.wait())
        local.add_done_callback(_consume)  # it may fail after another part did, with nobody waiting
        parts = [local, *(completion for _, _, _, completion in self._parts)]
        try:
            await asyncio.wait(parts, return_when=asyncio.FIRST_EXCEPTION)
            for part in parts:
                if part.done() and not part.cancelled() and part.exception() is not None:
                    raise part.exception()  # type: ignore[misc]
            stats = [part.result() for part in parts]
        except BaseException as error:
            self.cancel(f"transfer {self.transfer_id!r} failed on another rank: {error}")
            raise
        return TransferStats.of_parts(stats)


class RankReceivers:
    """A tensor-parallel decode worker's KV receivers: rank 0's `local` one and each
    follower's, behind one `expect` (see the module docstring). Event loop only.

    Args:
        local: rank 0's started `KVReceiver`.
        connections: the leader's end of each follower's control pipe, rank order
            (`LockstepEngine.rank_links`).
    """

    def __init__(self, local: KVReceiver, connections: Sequence[Connection]) -> None:
        self.local = local
        self._links = [_RankLink(rank, connection) for rank, connection in enumerate(connections, start=1)]
        self._loop: asyncio.AbstractEventLoop | None = None
        # Each expectation's parts get ids of their own ("<id>/rank<r>.<n>"): a follower's
        # late verdict on an earlier expectation of the same transfer id (its deadline
        # firing after the leader gave up on it) must not settle a new one.
        self._expectations = itertools.count()

    @property
    def address(self) -> str:
        return self.local.address

    @property
    def rank_addresses(self) -> list[str]:
        """Each follower's bulk endpoint (after `start`)."""
        return [link.address for link in self._links]

    async def start(self, *, host: str, model_id: str, advertise_host: str | None = None,
                    internal_token: str | None = None, tls: TlsConfig | None = None,
                    timeout_s: float = LISTEN_TIMEOUT_S) -> None:
        """Start every follower's endpoint (on `host`, any free port) and learn its address."""
        self._loop = loop = asyncio.get_running_loop()
        for link in self._links:
            link.listening = loop.create_future()
            loop.add_reader(link.connection.fileno(), self._readable, link)
            link.send(Listen(host, advertise_host, internal_token, model_id, tls))
        replies = await asyncio.wait_for(asyncio.gather(*(link.listening for link in self._links)), timeout_s)
        for link, reply in zip(self._links, replies):
            link.address, link.layout = reply.address, reply.layout
        log.info("tensor-parallel KV receivers listening", addresses=self.rank_addresses)

    def expect(
        self,
        transfer_id: str,
        block_ids: Sequence[int],
        *,
        num_cached_blocks: int = 0,
        timeout_s: float | None = None,
        deadline_unix_s: float | None = None,
        transport: TransportKind = TransportKind.TCP,
        nccl: NcclCommunicator | None = None,
        worker_id: str = "",
        control_address: str = "",
    ) -> RankedTransfer:
        """Register a transfer on every rank (`KVReceiver.expect`'s arguments; the followers'
        parts are TCP and share rank 0's deadline). Await `registered()` before handing
        out the handle."""
        local = self.local.expect(transfer_id, block_ids, num_cached_blocks=num_cached_blocks, timeout_s=timeout_s,
                                  deadline_unix_s=deadline_unix_s, transport=transport, nccl=nccl,
                                  worker_id=worker_id, control_address=control_address)
        loop = asyncio.get_running_loop()
        parts = []
        expectation = next(self._expectations)
        try:
            for link in self._links:
                part_id = f"{transfer_id}/rank{link.rank}.{expectation}"
                registration, completion = loop.create_future(), loop.create_future()
                registration.add_done_callback(_consume)
                completion.add_done_callback(_consume)
                link.registrations[part_id], link.completions[part_id] = registration, completion
                parts.append((link, part_id, registration, completion))
                link.send(Expect(part_id, tuple(block_ids), num_cached_blocks, local.handle.deadline_unix_s, worker_id))
        except BaseException:
            local.cancel("a tensor-parallel rank could not take the transfer")
            for link, part_id, _, _ in parts:
                _cancel_quietly(link, part_id)
            raise
        return RankedTransfer(local, parts)

    async def close(self) -> None:
        """Stop reading the pipes and fail what waits on them (the followers' endpoints end
        with their processes)."""
        for link in self._links:
            if self._loop is not None and link.lost is None:
                self._loop.remove_reader(link.connection.fileno())
            self._lose(link, FailedPrecondition("the receiver is shutting down"))

    # -- the pipes --------------------------------------------------------------------------

    def _readable(self, link: _RankLink) -> None:
        try:
            while link.connection.poll():
                self._on_message(link, link.connection.recv())
        except (EOFError, OSError):
            assert self._loop is not None
            self._loop.remove_reader(link.connection.fileno())
            self._lose(link, Unavailable(f"tensor-parallel rank {link.rank} of this decode worker stopped"))

    def _on_message(self, link: _RankLink, message: ToLeader) -> None:
        if isinstance(message, Listening):
            _settle(link.listening, message)
        elif isinstance(message, ListenFailed):
            _settle(link.listening, error=FailedPrecondition(
                f"tensor-parallel rank {link.rank} could not start its KV receiver: {message.error}"))
        elif isinstance(message, Registered):
            _settle(link.registrations.pop(message.transfer_id, None), message.handle)
        elif isinstance(message, RegistrationFailed):
            _settle(link.registrations.pop(message.transfer_id, None), error=message.error)
            link.completions.pop(message.transfer_id, None)
        elif isinstance(message, Done):
            _settle(link.completions.pop(message.transfer_id, None), message.stats)
        elif isinstance(message, Failed):
            _settle(link.completions.pop(message.transfer_id, None), error=message.error)

    def _lose(self, link: _RankLink, error: CleaveError) -> None:
        link.lost = error
        _settle(link.listening, error=error)
        for future in [*link.registrations.values(), *link.completions.values()]:
            _settle(future, error=error)
        link.registrations.clear()
        link.completions.clear()


def _settle(future: asyncio.Future | None, result: object = None, error: BaseException | None = None) -> None:
    if future is None or future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


def _cancel_quietly(link: _RankLink, transfer_id: str) -> None:
    try:
        link.send(Cancel(transfer_id, "registration abandoned"))
    except (CleaveError, OSError):
        pass


def _consume(future: asyncio.Future) -> None:
    """Mark a future's error as seen (the waiter, if any, raises it itself)."""
    if not future.cancelled():
        future.exception()
