"""CPU cores that groups of processes used over a bench's measured window, read from /proc.

A serving bench runs the stack's services, its client processes and itself on one host; when
their CPU use adds up to the host's cores, latency grows for reasons that are not the
stack's. `CpuMeter` takes each group's CPU seconds (user + system, of each process and its
descendants, e.g. a worker's tensor-parallel ranks) at the start and at the end of the
window; `cores` divides the difference by the wall time. Processes that exit inside the
window are left out (measure those in the process itself, with `time.process_time`).

    meter = CpuMeter({"gateway": [pid1, pid2], "decode": [pid3]})
    ...                                     # the measured window
    meter.cores(wall_s)                     # {"gateway": 1.7, "decode": 1.0}
    meter.seconds()                         # {"gateway": 25.5, "decode": 15.0}: CPU seconds

Linux only: elsewhere every group reads 0 CPU seconds.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

PROC = Path("/proc")
CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _stat_fields(pid: int) -> list[str] | None:
    """The fields of /proc/<pid>/stat after the command name (None when the process is gone)."""
    try:
        text = (PROC / str(pid) / "stat").read_text()
    except OSError:
        return None
    return text[text.rindex(")") + 2 :].split()  # the name may hold spaces and parentheses


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of one process (all its threads); 0 when it is gone."""
    fields = _stat_fields(pid)
    if fields is None:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS  # utime, stime (fields 14 and 15 of stat)


def _children_by_parent() -> dict[int, list[int]]:
    children: dict[int, list[int]] = {}
    for entry in PROC.glob("[0-9]*"):
        fields = _stat_fields(int(entry.name))
        if fields is not None:
            children.setdefault(int(fields[1]), []).append(int(entry.name))
    return children


def with_descendants(pids: Iterable[int]) -> list[int]:
    """`pids` and every live process below them."""
    children = _children_by_parent()
    found: list[int] = []
    pending = list(pids)
    while pending:
        pid = pending.pop()
        if pid not in found:
            found.append(pid)
            pending.extend(children.get(pid, ()))
    return found


class CpuMeter:
    """CPU seconds of named process groups from now on (see the module docstring).

    Args:
        groups: name -> the pids of the group's top processes.
    """

    def __init__(self, groups: Mapping[str, Sequence[int]]) -> None:
        self._pids = {name: with_descendants(pids) for name, pids in groups.items()}
        self._start = self._seconds()

    def _seconds(self) -> dict[str, float]:
        return {name: sum(cpu_seconds(pid) for pid in pids) for name, pids in self._pids.items()}

    def seconds(self) -> dict[str, float]:
        """Each group's CPU seconds since the meter started."""
        end = self._seconds()
        return {name: end[name] - self._start[name] for name in end}

    def cores(self, wall_s: float) -> dict[str, float]:
        """Each group's CPU seconds since the meter started, per second of `wall_s`."""
        return {name: round(used / max(wall_s, 1e-9), 2) for name, used in self.seconds().items()}


def role_of(child_name: str) -> str:
    """A stack child's group: `gateway-1` -> gateway, `decode-0` -> decode, `kvstore` -> kvstore."""
    return child_name.split("-", 1)[0]
