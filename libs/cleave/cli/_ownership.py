"""`cleave up` owns its children: they die with it, and it never starts on a busy port.

Children run in sessions of their own (a terminal's Ctrl-C reaches only `cleave up`, which
stops them in order), so nothing else would stop them if `cleave up` itself died without
its `finally` (SIGKILL, an unhandled crash). On Linux each child asks the kernel for a
signal when its parent dies (`prctl(PR_SET_PDEATHSIG)`): SIGTERM, so it drains its grace
period and exits, freeing its ports. The kernel sends it when the parent *thread* that
forked the child ends, so children are spawned from a thread that lives as long as the
stack (the main thread under `cleave up`).

The gateway's ports are checked before anything loads: a busy port fails in a second with
one line naming it, not after every worker loaded its model.
"""

from __future__ import annotations

import ctypes
import errno
import os
import signal
import socket
import sys
from collections.abc import Callable, Iterable

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


class PortInUse(RuntimeError):
    """A port the stack must listen on is taken."""


def die_with_parent(death_signal: int = signal.SIGTERM) -> Callable[[], None] | None:
    """A `preexec_fn` that has the child receive `death_signal` when this process dies
    (None off Linux, or where libc cannot be loaded)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)  # this process's libc, resolved here: the child only calls it
        prctl = libc.prctl
    except (OSError, AttributeError):
        return None
    parent = os.getpid()

    def preexec() -> None:
        prctl(PR_SET_PDEATHSIG, death_signal, 0, 0, 0)
        if os.getppid() != parent:  # the parent died before prctl: the signal would never come
            os.kill(os.getpid(), death_signal)

    return preexec


def check_ports_free(host: str, ports: Iterable[tuple[int, str]]) -> None:
    """Raise PortInUse naming the first of `ports` ((port, what it is for); 0: any port,
    skipped) that cannot be bound on `host`."""
    for port, what in ports:
        if port == 0:
            continue
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
            # as the servers bind: a port left in TIME_WAIT by a stopped stack is free
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind((host, port))
            except OSError as error:
                reason = "is in use" if error.errno == errno.EADDRINUSE else f"cannot be bound ({error.strerror})"
                raise PortInUse(
                    f"port {port} on {host} ({what}) {reason}; stop what listens there "
                    f"(`ss -ltnp 'sport = :{port}'` names it) or choose another port"
                ) from None
