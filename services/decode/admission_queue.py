"""Admissions that wait for KV blocks instead of being refused.

When a decode worker's pool cannot hold a new prompt, or a preempted sequence of the same
or a more urgent priority waits to be recomputed (freed blocks go to it first:
`KVHandoff.reserve`), its Admit waits here, in order of priority (the request's `priority`,
lower first) and then of arrival, until running requests finish or reservations are
released; only past
`max_waiting` waiting admissions is it refused (RESOURCE_EXHAUSTED with a retry hint), as a
colocated worker's scheduler queues prompts rather than refusing them. A prompt larger than
the whole pool is refused at once: no amount of waiting would make it fit.

Only the head of the queue tries to reserve, each time blocks may have been freed (`wake()`:
after every engine step and every released reservation), so a small prompt never overtakes
a large one that has waited longer at its priority; an admission of a lower priority value
than every waiting one tries at once. A waiting Admit that is cancelled (the prefill worker
gave up) leaves the queue and holds nothing.
"""

from __future__ import annotations

import asyncio
import bisect
import itertools
from collections.abc import Awaitable, Callable

from cleave.errors import CleaveError, ResourceExhausted
from cleave.kv.block_pool import OutOfBlocksError

DEFAULT_MAX_QUEUED_ADMISSIONS = 256
RETRY_AFTER_S = 1.0  # a full queue's hint: about the time a few requests take to finish


class _Turn:
    """One waiting admission: woken when it may try again, or failed. `key`: its place in
    the queue, (priority, arrival order)."""

    def __init__(self, key: tuple[int, int]) -> None:
        self.key = key
        self.wakeup = asyncio.Event()
        self.error: CleaveError | None = None


class AdmissionQueue:
    """Bounded queue of admissions waiting for free blocks, by priority then arrival (see the
    module docstring).

    Args:
        max_waiting: admissions that may wait at once; one more is RESOURCE_EXHAUSTED.
    """

    def __init__(self, max_waiting: int = DEFAULT_MAX_QUEUED_ADMISSIONS) -> None:
        if max_waiting < 0:
            raise ValueError(f"max_waiting must be >= 0, got {max_waiting}")
        self.max_waiting = max_waiting
        self._waiting: list[_Turn] = []  # sorted by key: the head tries next
        self._arrivals = itertools.count()

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    async def reserve(self, attempt: Callable[[], Awaitable[list[int]]], priority: int = 0) -> list[int]:
        """`attempt()` (a reservation that raises OutOfBlocksError when the pool is short),
        at once when nobody waits at `priority` or a lower value, else in turn once blocks
        were freed."""
        if not self._waiting or priority < self._waiting[0].key[0]:
            try:
                return await attempt()
            except OutOfBlocksError:
                pass
        if len(self._waiting) >= self.max_waiting:
            error = ResourceExhausted(
                f"the decode worker's KV cache is full and {len(self._waiting)} admissions already wait "
                f"(--max-queued-admissions {self.max_waiting}); retry later or on another worker")
            error.retry_after_s = RETRY_AFTER_S
            raise error
        turn = _Turn((priority, next(self._arrivals)))
        bisect.insort(self._waiting, turn, key=lambda waiting: waiting.key)
        try:
            while True:
                await turn.wakeup.wait()
                turn.wakeup.clear()
                if turn.error is not None:
                    raise turn.error
                if self._waiting[0] is not turn:
                    continue
                try:
                    return await attempt()
                except OutOfBlocksError:
                    continue
        finally:
            was_head = self._waiting[0] is turn
            self._waiting.remove(turn)
            if was_head:
                self.wake()  # the next one may fit in what is left

    def wake(self) -> None:
        """Blocks may have been freed: let the head try again."""
        if self._waiting:
            self._waiting[0].wakeup.set()

    def fail_all(self, error: CleaveError) -> None:
        """End every waiting admission with `error` (the worker drains)."""
        for turn in self._waiting:
            turn.error = error
            turn.wakeup.set()
