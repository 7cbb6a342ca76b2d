"""Watchers of the store's block set: a snapshot, then every change, to each subscriber.

A prefill worker keeps an index of the stored hashes (`cleave.transfer.kvstore_index`) so
that a prompt that misses (nearly all of them) costs no Lookup round trip. Every worker
watches, so publishing must never wait for one: each watcher has a queue bounded in hashes,
and a watcher whose queue would overflow is ended (ResourceExhausted) and dropped at once;
its client calls Watch again and gets a fresh snapshot. The store publishes on its event
loop, synchronously with the change, so a snapshot taken at `subscribe` plus the events
published after it is exactly the store's set.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator, Sequence

from cleave.errors import CleaveError, ResourceExhausted, Unavailable
from services.kvstore.backend import BlockEvent

EVENT_MAX_HASHES = 4096  # hashes per message (128 KiB of 32-byte hashes)
WATCH_QUEUE_HASHES = 1 << 16  # hashes a watcher may have queued before it is ended


def _parts(hashes: Sequence[bytes]) -> list[tuple[bytes, ...]]:
    return [tuple(hashes[start:start + EVENT_MAX_HASHES]) for start in range(0, len(hashes), EVENT_MAX_HASHES)]


class Watcher:
    """One subscriber: its snapshot, then its queue of events, until it is ended."""

    def __init__(self, hub: WatchHub, snapshot: list[bytes], max_queued_hashes: int) -> None:
        self._hub = hub
        self._snapshot: list[bytes] | None = snapshot
        self._queue: deque[BlockEvent] = deque()
        self._num_queued_hashes = 0
        self.max_queued_hashes = max_queued_hashes
        self._wake = asyncio.Event()
        self._is_ended = False
        self._error: CleaveError | None = None  # raised to the reader once ended with one

    def offer(self, event: BlockEvent) -> bool:
        """Queue an event; False (and the watcher ended) when it would overflow the queue."""
        size = len(event.stored) + len(event.removed)
        if self._num_queued_hashes + size > self.max_queued_hashes:
            self.end(ResourceExhausted(
                f"this watcher fell behind: {self._num_queued_hashes + size} hashes queued, at most "
                f"{self.max_queued_hashes}; call Watch again for a fresh snapshot"))
            return False
        self._queue.append(event)
        self._num_queued_hashes += size
        self._wake.set()
        return True

    def end(self, error: CleaveError | None = None) -> None:
        """Stop the stream: with `error` the reader raises it, else its stream just ends."""
        if self._is_ended:
            return
        self._is_ended, self._error = True, error
        self._queue.clear()  # an ended watcher holds nothing
        self._num_queued_hashes = 0
        self._snapshot = None
        self._wake.set()
        self._hub.unsubscribe(self)

    async def events(self) -> AsyncIterator[BlockEvent]:
        """The snapshot in parts (the last flagged `snapshot_done`), then the queued events."""
        snapshot, self._snapshot = self._snapshot or [], None
        for start in range(0, max(len(snapshot), 1), EVENT_MAX_HASHES):
            if self._is_ended:
                break
            end = start + EVENT_MAX_HASHES
            yield BlockEvent(stored=tuple(snapshot[start:end]), snapshot_done=end >= len(snapshot))
        while True:
            if self._error is not None:
                raise self._error
            if self._is_ended:
                return
            if not self._queue:
                self._wake.clear()
                await self._wake.wait()
                continue
            event = self._queue.popleft()
            self._num_queued_hashes -= len(event.stored) + len(event.removed)
            for part in _parts(event.stored):
                yield BlockEvent(stored=part)
            for part in _parts(event.removed):
                yield BlockEvent(removed=part)


class WatchHub:
    """The store's watchers; `publish` hands each change to every one without waiting."""

    def __init__(self, max_queued_hashes: int = WATCH_QUEUE_HASHES) -> None:
        self.max_queued_hashes = max_queued_hashes
        self._watchers: set[Watcher] = set()
        self._is_closed = False
        self.num_overflowed = 0  # watchers ended for falling behind

    def __len__(self) -> int:
        return len(self._watchers)

    def subscribe(self, snapshot: list[bytes]) -> Watcher:
        """A watcher that starts from `snapshot` (the store's hashes now: take it and call
        this with no await in between, so that no change falls between the two)."""
        if self._is_closed:
            raise Unavailable("the kvstore is shutting down; call Watch on it again once it is back")
        watcher = Watcher(self, snapshot, self.max_queued_hashes)
        self._watchers.add(watcher)
        return watcher

    def unsubscribe(self, watcher: Watcher) -> None:
        self._watchers.discard(watcher)

    def publish(self, stored: Sequence[bytes] = (), removed: Sequence[bytes] = ()) -> None:
        """Tell every watcher: `stored` are stored now, `removed` are not."""
        events = [BlockEvent(stored=tuple(stored))] if stored else []
        if removed:
            events.append(BlockEvent(removed=tuple(removed)))
        for event in events:
            for watcher in list(self._watchers):
                if not watcher.offer(event):
                    self.num_overflowed += 1

    def close(self) -> None:
        """End every watcher's stream (the store shuts down) and refuse new ones."""
        self._is_closed = True
        for watcher in list(self._watchers):
            watcher.end()
