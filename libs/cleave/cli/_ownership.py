"""`cleave up` owns its children: they die with it, and it never starts on a busy port.

Children run in sessions of their own (a terminal's Ctrl-C reaches only `cleave up`, which
stops them in order), so nothing else would stop them if `cleave up` itself died without
its `finally` (SIGKILL, an unhandled crash): each is started with `--parent-pid` and asks
the kernel itself for SIGTERM when `cleave up` dies (`cleave.parent_death`), so it drains
its grace period and exits, freeing its ports.

The gateway's ports are checked before anything loads: a busy port fails in a second with
one line naming it, not after every worker loaded its model.
"""

from __future__ import annotations

import errno
import socket
from collections.abc import Iterable


class PortInUse(RuntimeError):
    """A port the stack must listen on is taken."""


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
