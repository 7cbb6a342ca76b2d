"""How many requests one API key may have running through a gateway at once.

A gateway serves every tenant from one set of workers, so one tenant that opens thousands of
streams fills the decode workers' batches and queues for everyone. With
`--max-requests-per-key N` a request beyond its key's N running ones is refused at once
(RESOURCE_EXHAUSTED over gRPC, 429 over HTTP, both with a one-second Retry-After) instead
of queueing; the others' requests are untouched. With several API keys each key is counted
on its own (`GenerateSpec.tenant`); with one key or none, every request counts against one
shared limit. A request counts from its arrival to its end, whatever its number of samples.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

from cleave.errors import ResourceExhausted
from services.gateway.backend import BackendLayer, GatewayBackend, GenerateChunk, GenerateSpec


class TenantBusy(ResourceExhausted):
    """The request's API key has as many requests running as the gateway takes from one."""

    retry_after_s = 1.0


class TenantLimits(BackendLayer):
    """A GatewayBackend that refuses a tenant's request while `max_requests` of its own run.

    Args:
        backend: the serving logic.
        max_requests: requests one tenant may have running at once (at least 1).
    """

    def __init__(self, backend: GatewayBackend, max_requests: int) -> None:
        if max_requests < 1:
            raise ValueError(f"max_requests must be at least 1, got {max_requests}")
        super().__init__(backend)
        self.max_requests = max_requests
        self._running: dict[str, int] = {}  # tenant -> its requests running now

    def running(self, tenant: str = "") -> int:
        """Requests `tenant` has running now."""
        return self._running.get(tenant, 0)

    async def generate(self, spec: GenerateSpec) -> AsyncIterator[GenerateChunk]:
        tenant = spec.tenant
        running = self._running.get(tenant, 0)
        if running >= self.max_requests:
            raise TenantBusy(f"this API key has {running} requests running, the most the gateway takes from one "
                             "key at once (--max-requests-per-key); retry when one has ended")
        self._running[tenant] = running + 1
        try:
            async with contextlib.aclosing(self.backend.generate(spec)) as chunks:
                async for chunk in chunks:
                    yield chunk
        finally:
            left = self._running[tenant] - 1
            if left:
                self._running[tenant] = left
            else:
                del self._running[tenant]
