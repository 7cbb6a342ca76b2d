"""A child process that ends with the process that started it.

`cleave up` starts every service with `--parent-pid` (its own pid); the service asks the
kernel, first thing in `run_service`, for SIGTERM when that parent dies
(`prctl(PR_SET_PDEATHSIG)`, Linux), so it drains and frees its ports however `cleave up`
ended (SIGKILL included). The child asks for itself, after exec: a `preexec_fn` would run
Python between fork and exec in a parent whose gRPC threads hold locks, which aborts the
child now and then. A parent that died before the request is caught by comparing the
parent pid. The kernel sends the signal when the parent *thread* that forked the child ends,
so parents spawn from a thread that lives as long as the children (`cleave up`'s main thread).
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def follow_parent(parent_pid: int | None, death_signal: int = signal.SIGTERM) -> bool:
    """Have this process get `death_signal` when `parent_pid` dies; signals itself at once
    when the parent is gone already. False where it cannot be arranged (no parent given,
    not Linux, no libc)."""
    if parent_pid is None or not sys.platform.startswith("linux"):
        return False
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return False
    if prctl(PR_SET_PDEATHSIG, int(death_signal), 0, 0, 0) != 0:
        return False
    if os.getppid() != parent_pid:  # it died before the request: the signal would never come
        os.kill(os.getpid(), death_signal)
    return True
