"""Progress of a run on stderr: a redrawn bar on a terminal, a plain line every few seconds
otherwise (logs and CI keep readable output)."""

from __future__ import annotations

import sys
import time
from typing import TextIO

from cleave.benchmark.records import RequestRecord

_BAR_WIDTH = 30
_REDRAW_S = 0.1
_LINE_EVERY_S = 5.0


class Progress:
    """Counts finished requests; call `done` per record and `close` at the end."""

    def __init__(self, total: int, label: str = "", stream: TextIO | None = None) -> None:
        self.total = total
        self.label = label
        self.stream = stream if stream is not None else sys.stderr
        self.is_tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.completed = 0
        self.failed = 0
        self.start = time.monotonic()
        self._last_shown = -float("inf")

    def done(self, record: RequestRecord) -> None:
        if record.success:
            self.completed += 1
        else:
            self.failed += 1
        now = time.monotonic()
        finished = self.completed + self.failed == self.total
        if finished or now - self._last_shown >= (_REDRAW_S if self.is_tty else _LINE_EVERY_S):
            self._last_shown = now
            self._show(now)

    def line(self, now: float | None = None) -> str:
        elapsed = (time.monotonic() if now is None else now) - self.start
        finished = self.completed + self.failed
        rate = finished / elapsed if elapsed > 0 else 0.0
        prefix = f"{self.label} " if self.label else ""
        return (f"{prefix}{finished}/{self.total} requests ({self.failed} failed), "
                f"{elapsed:.1f} s, {rate:.2f} req/s")

    def _show(self, now: float) -> None:
        if self.is_tty:
            filled = _BAR_WIDTH * (self.completed + self.failed) // max(self.total, 1)
            bar = "#" * filled + "." * (_BAR_WIDTH - filled)
            self.stream.write(f"\r[{bar}] {self.line(now)}\x1b[K")
        else:
            self.stream.write(self.line(now) + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.is_tty:
            self.stream.write("\n")
            self.stream.flush()
