"""How many client connections a server of this process holds at once.

Every connection is a file descriptor. A process out of descriptors cannot accept (asyncio
logs and retries), and worse, cannot open anything else: a gateway could no longer reach its
workers, a worker no longer write a trace line. So each server caps its connections below
the process's open-file limit: gRPC servers through grpc's
`grpc.max_allowed_incoming_connections` (a connection past it is closed at once; clients
see UNAVAILABLE and may retry), the gateway's HTTP API in `services.gateway.http_errors`
(answered 503 with `Retry-After`, then closed).

By default a process first raises its soft open-file limit towards the hard one
(`raise_open_file_limit`, as vLLM's servers do: the common soft default of 1024 is a few
hundred streaming clients), and each server takes half of what is left after
`FD_RESERVE` descriptors for the process's own files and channels (the gateway runs two
servers: gRPC and HTTP).
"""

from __future__ import annotations

import resource

OPEN_FILE_TARGET = 65536  # soft limit asked for at start-up, within the hard limit
FD_RESERVE = 256  # descriptors kept for the process's own files, pipes and outgoing channels
MIN_CONNECTIONS = 16


def raise_open_file_limit(target: int = OPEN_FILE_TARGET) -> int:
    """Raise the soft RLIMIT_NOFILE to `target` (or the hard limit, if lower); never lowers
    it. Returns the soft limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = target if hard == resource.RLIM_INFINITY else min(target, hard)
    if soft != resource.RLIM_INFINITY and soft < wanted:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
            soft = wanted
        except (ValueError, OSError):  # a sandbox that refuses: the limit stays as it was
            pass
    return soft


def connection_cap(configured: int | None) -> int:
    """`configured` (`--max-connections`), else half the soft open-file limit past FD_RESERVE."""
    if configured is not None:
        return configured
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        soft = OPEN_FILE_TARGET
    return max(MIN_CONNECTIONS, (soft - FD_RESERVE) // 2)
