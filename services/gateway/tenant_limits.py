"""How many requests, and how many samples, one API key may have running through a gateway at once.

A gateway serves every tenant from one set of workers, so one tenant that opens thousands of
streams, or sends one request of hundreds of samples, fills the decode workers' batches and
queues for everyone. Two caps, each off at 0, bound a key's share:

- `--max-requests-per-key N`: a request beyond its key's N running ones is refused, whatever
  its number of samples;
- `--max-samples-per-key N`: a request whose samples would take its key's running samples past
  N is refused. A request's samples are `sampling.n`, or `scaling.num_samples` under a scaling
  strategy (`services.gateway.backend.num_samples`, as the router asks the workers for them). A
  request that asks for more than N by itself could never run: it is INVALID_ARGUMENT / 400
  naming that field.

A refused request is refused at once (RESOURCE_EXHAUSTED over gRPC, 429 over HTTP, both with a
one-second Retry-After) instead of queueing; the others' requests are untouched. With several
API keys each key is counted on its own (`GenerateSpec.tenant`); with one key or none, every
request counts against one shared limit. A request counts from its arrival to its end, however
it ends, and each of its samples until the stream reports it finished (a streamed sample that
ends early frees its place at once; held answers, as majority vote's, report their samples at
the request's end); each prompt of a completions batch is a request of its own and counts its samples, and
a batch whose prompts together could never fit under a cap is INVALID_ARGUMENT / 400 naming
`prompt` (refused with a Retry-After, its client would retry it forever).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass

from cleave.errors import InvalidArgument, ResourceExhausted
from services.gateway.backend import (
    BackendLayer,
    GatewayBackend,
    GenerateChunk,
    GenerateSpec,
    num_samples,
    num_samples_field,
)


class TenantBusy(ResourceExhausted):
    """The request's API key has as many requests, or samples, running as the gateway takes from one."""

    retry_after_s = 1.0


@dataclass
class _Running:
    """What one tenant has running now."""

    requests: int = 0
    samples: int = 0


class TenantLimits(BackendLayer):
    """A GatewayBackend that refuses a tenant's request while `max_requests` of its own run, or
    while its running samples and the request's would be more than `max_samples`.

    Args:
        backend: the serving logic.
        max_requests: requests one tenant may have running at once; 0 or None: no cap.
        max_samples: samples one tenant may have running at once, summed over its requests;
            0 or None: no cap.
    """

    def __init__(self, backend: GatewayBackend, max_requests: int | None = None,
                 max_samples: int | None = None) -> None:
        for name, cap in (("max_requests", max_requests), ("max_samples", max_samples)):
            if cap is not None and cap < 0:
                raise ValueError(f"{name} must be >= 0 (0: no cap), got {cap}")
        if not max_requests and not max_samples:
            raise ValueError("give max_requests or max_samples: with neither there is nothing to limit")
        super().__init__(backend)
        self.max_requests = max_requests or None
        self.max_samples = max_samples or None
        self._running: dict[str, _Running] = {}  # tenant -> what it has running now

    def running(self, tenant: str = "") -> int:
        """Requests `tenant` has running now."""
        running = self._running.get(tenant)
        return running.requests if running else 0

    def running_samples(self, tenant: str = "") -> int:
        """Samples `tenant`'s running requests asked for."""
        running = self._running.get(tenant)
        return running.samples if running else 0

    def _admit(self, spec: GenerateSpec, samples: int) -> _Running:
        """The tenant's running counts with `spec` taken into them; raises if it may not run."""
        if self.max_samples is not None and samples > self.max_samples:
            raise InvalidArgument(f"{samples} samples are more than one API key may have running at once on this "
                                  f"gateway (--max-samples-per-key {self.max_samples}); ask for at most "
                                  f"{self.max_samples}", field=num_samples_field(spec))
        # A body's prompts run at once: a list that could never fit is the body's fault, not a wait.
        if self.max_requests is not None and spec.batch_size > self.max_requests:
            raise InvalidArgument(f"a list of {spec.batch_size} prompts runs as many requests at once, more than "
                                  f"one API key may have running on this gateway (--max-requests-per-key "
                                  f"{self.max_requests}); send at most {self.max_requests} a body", field="prompt")
        if self.max_samples is not None and samples * spec.batch_size > self.max_samples:
            raise InvalidArgument(f"a list of {spec.batch_size} prompts of {samples} samples each runs "
                                  f"{samples * spec.batch_size} samples at once, more than one API key may have "
                                  f"running on this gateway (--max-samples-per-key {self.max_samples}); send at most "
                                  f"{self.max_samples // samples} prompts a body", field="prompt")
        running = self._running.get(spec.tenant) or _Running()
        if self.max_requests is not None and running.requests >= self.max_requests:
            raise TenantBusy(f"this API key has {running.requests} requests running, the most the gateway takes "
                             "from one key at once (--max-requests-per-key); retry when one has ended")
        if self.max_samples is not None and running.samples + samples > self.max_samples:
            raise TenantBusy(f"this API key has requests of {running.samples} samples running, and this "
                             f"request's {samples} would take it past the {self.max_samples} the gateway runs "
                             "for one key at once (--max-samples-per-key); retry when one has ended")
        running.requests += 1
        running.samples += samples
        self._running[spec.tenant] = running
        return running

    async def generate(self, spec: GenerateSpec) -> AsyncIterator[GenerateChunk]:
        samples = num_samples(spec)
        running = self._admit(spec, samples)
        finished: set[int] = set()
        try:
            async with contextlib.aclosing(self.backend.generate(spec)) as chunks:
                async for chunk in chunks:
                    for sample in chunk.samples:
                        if sample.finish_reason is not None and sample.index not in finished and len(finished) < samples:
                            finished.add(sample.index)
                            running.samples -= 1
                    yield chunk
        finally:
            running.requests -= 1
            running.samples -= samples - len(finished)
            if not running.requests:
                del self._running[spec.tenant]
