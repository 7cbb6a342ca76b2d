"""Conditional disaggregation: per request, prefill on a prefill worker or on the decode
worker that will decode it.

A remote prefill keeps a prompt's compute off the decode worker's steps (no stall for the
requests streaming there) but costs a hop and a KV transfer; a local one costs nothing extra
for a short prompt, or for one whose prefix the decode worker already caches, as long as
few requests stream there to be stalled by it. So a request prefills remotely when a prefill
worker is in rotation and either
  - the prompt tokens its decode worker does not already cache exceed `local_max_tokens`,
    and the least loaded prefill worker has at most `remote_max_queue_tokens` prompt tokens
    queued (past that, waiting there costs more than interleaving the prompt with the decode
    steps); or
  - its decode worker has more than `local_max_running` requests (running or waiting), so
    that every local prefill there delays them all, and the least loaded prefill worker has at
    most `remote_busy_max_queue_tokens` queued: a short prompt waiting behind a long one
    there would miss its first token by more than it stalls the decode steps; or
  - the least loaded prefill worker has at most `remote_idle_tokens` queued, however short
    the prompt: a prefill worker with room takes the prompt off the decode worker's steps
    (0, the default, turns this off).
What the decode workers cache is tracked here from the prompts the gateway sent them (the
same chained block hashes as prefill affinity), as an estimate: the worker decides for real.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from services.gateway.routing import AFFINITY_BLOCK_SIZE, PrefixAffinity, decode_load, prefill_load
from services.gateway.workers import WorkerHandle


@dataclass(frozen=True)
class DisaggregationPolicy:
    """Thresholds of conditional mode (see the module docstring)."""

    local_max_tokens: int = 1024
    remote_max_queue_tokens: int = 65536
    remote_idle_tokens: int = 0
    local_max_running: int = 32
    remote_busy_max_queue_tokens: int = 8192

    def __post_init__(self) -> None:
        if min(self.local_max_tokens, self.remote_max_queue_tokens, self.remote_idle_tokens,
               self.local_max_running, self.remote_busy_max_queue_tokens) < 0:
            raise ValueError("the conditional-disaggregation thresholds must be >= 0")


class ConditionalPrefill:
    """Decides where each request of a conditional-mode gateway prefills."""

    def __init__(self, policy: DisaggregationPolicy) -> None:
        self.policy = policy
        self.decode_prefixes = PrefixAffinity()  # prompt prefix -> decode worker holding it

    def cached_on(self, decode: WorkerHandle, prompt_ids: Sequence[int], hashes: Sequence[bytes] | None = None) -> int:
        """Leading prompt tokens the decode worker likely caches."""
        owner, num_blocks = self.decode_prefixes.lookup(prompt_ids, hashes)
        return num_blocks * AFFINITY_BLOCK_SIZE if owner == decode.address else 0

    def remote(self, decode: WorkerHandle, prefill_workers: Sequence[WorkerHandle], prompt_ids: Sequence[int],
               hashes: Sequence[bytes] | None = None) -> bool:
        """Whether the request should prefill on a prefill worker (`hashes`: the prompt's
        `decode_prefixes.hashes`, when the caller has them already)."""
        if not prefill_workers:
            return False
        queued = min(prefill_load(worker) for worker in prefill_workers)
        if self.policy.remote_idle_tokens and queued <= self.policy.remote_idle_tokens:
            return True
        uncached = len(prompt_ids) - self.cached_on(decode, prompt_ids, hashes)
        if uncached > self.policy.local_max_tokens:
            return queued <= self.policy.remote_max_queue_tokens
        return (decode_load(decode) > self.policy.local_max_running
                and queued <= self.policy.remote_busy_max_queue_tokens)

    def record(self, decode: WorkerHandle, prompt_ids: Sequence[int], hashes: Sequence[bytes] | None = None) -> None:
        """The request's prompt is now (being) cached on `decode`."""
        self.decode_prefixes.record(prompt_ids, decode.address, hashes)

    def choose(self, decode: WorkerHandle, prefill_workers: Sequence[WorkerHandle], prompt_ids: Sequence[int],
               hashes: Sequence[bytes] | None = None) -> bool:
        """`remote`, then `record` (the prompt goes to `decode` either way), hashing it at most
        once (`hashes`: the prompt's `decode_prefixes.hashes`, when the caller has them)."""
        if hashes is None:
            hashes = self.decode_prefixes.hashes(prompt_ids)
        remote = self.remote(decode, prefill_workers, prompt_ids, hashes)
        self.record(decode, prompt_ids, hashes)
        return remote
