"""Keep the objects alive before a generation loop out of the garbage collector's full walks.

An in-process engine (the offline `LLM`) shares its process with hundreds of thousands of
long-lived Python objects: torch and transformers modules, the model, compiled kernels.
CPython runs a full (oldest-generation) collection whenever the objects that survived into
that generation since the last one reach a quarter of it, and each walks every one of them:
a decode loop at batch 256 pays ~125 ms about every 100-130 steps on a 2-core VM, ~1.3 ms
per step, while the device waits (the heap of a CUDA process is larger still).

`frozen_heap()` moves every object alive at its entry to the permanent generation
(`gc.freeze`) for the duration of the block and back into the oldest generation at its exit
(`gc.unfreeze`), so full collections inside the block walk only what the loop itself keeps
alive. Both are O(1) list splices. Garbage made inside the block is collected as usual;
garbage already present at entry waits for the exit (nothing is collected at entry, which
would cost a full walk per call).

Workers freeze their start-up objects for good (`cleave.worker.gc_freeze`): where anything
is frozen already, the block changes nothing, so it never undoes someone else's freeze.
Nested and concurrent blocks share one freeze, undone by the last one to leave.
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["frozen_heap"]


class _FreezeHolders:
    """How many `frozen_heap` blocks are open, and whether they froze the heap."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.count = 0
        self.froze = False

    def enter(self) -> None:
        with self.lock:
            if self.count == 0:
                self.froze = gc.get_freeze_count() == 0
                if self.froze:
                    gc.freeze()
            self.count += 1

    def leave(self) -> None:
        with self.lock:
            self.count -= 1
            if self.count == 0 and self.froze:
                self.froze = False
                gc.unfreeze()


_HOLDERS = _FreezeHolders()


@contextmanager
def frozen_heap() -> Iterator[None]:
    """Within the block, full collections skip every object that was alive at its entry."""
    _HOLDERS.enter()
    try:
        yield
    finally:
        _HOLDERS.leave()
