"""`StoredIndex`: a prefill worker's copy of which blocks a kvstore holds.

Kept up to date by `KVStoreClient.watch` from the store's Watch stream (a snapshot, then
every change), it answers "how many leading blocks of this prompt are stored" with no round
trip. It is a hint, never the truth: a block evicted a moment ago is still listed (the Get
then returns fewer blocks than asked, and the prompt computes the rest), and one stored a
moment ago is not yet (a missed reuse). While it is not live (before the snapshot is
complete, after the stream broke) callers ask the store instead.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable, Sequence


class StoredIndex:
    """The chained hashes a kvstore holds for one layout, as its Watch stream last said."""

    def __init__(self) -> None:
        self._hashes: set[bytes] = set()
        self.is_live = False  # True from a complete snapshot until the stream breaks
        self._changed = asyncio.Event()  # replaced after each set: wakes `wait_until`

    def __len__(self) -> int:
        return len(self._hashes)

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self._hashes

    def num_leading(self, block_hashes: Sequence[bytes]) -> int:
        """How many leading hashes of a chain are stored (meaningful only while `is_live`)."""
        num_stored = 0
        for block_hash in block_hashes:
            if block_hash not in self._hashes:
                break
            num_stored += 1
        return num_stored

    def reset(self) -> None:
        """Forget everything and stop being live (a new snapshot follows)."""
        self._hashes.clear()
        self.is_live = False
        self._notify()

    def apply(self, stored: Iterable[bytes], removed: Iterable[bytes], snapshot_done: bool = False) -> None:
        """One message of the stream: add `stored`, drop `removed`; live once the snapshot is done."""
        self._hashes.update(stored)
        self._hashes.difference_update(removed)
        if snapshot_done:
            self.is_live = True
        self._notify()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def wait_until(self, predicate: Callable[[StoredIndex], bool], timeout_s: float) -> None:
        """Return once `predicate(self)` holds after a change (or now); raises TimeoutError
        after `timeout_s`. For start-up (wait for `is_live`) and tests."""
        async with asyncio.timeout(timeout_s):
            while not predicate(self):
                await self._changed.wait()
