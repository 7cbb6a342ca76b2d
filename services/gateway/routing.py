"""Which worker serves a request.

Decode: the least busy worker (requests this gateway has running there, plus the worker's
queue), ties broken by the most free KV blocks; workers whose last reported free blocks
cannot hold the prompt are used only when no worker can.

Prefill: prefix affinity first. The chained hashes of a prompt's leading full blocks map to
the prefill worker that last computed them (an LRU table), so a repeated system prompt or
conversation goes back to the worker whose prefix cache (and kvstore lookups) already hold
it — unless that worker is more than `AFFINITY_SLACK_TOKENS` queued prompt tokens busier
than the least loaded one, in which case load wins.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from cleave.kv.prefix_hash import block_hashes, salt_root
from services.gateway.workers import WorkerHandle

AFFINITY_SLACK_TOKENS = 2048
AFFINITY_BLOCK_SIZE = 16
AFFINITY_MAX_BLOCKS = 64  # only the leading blocks matter for routing
AFFINITY_CAPACITY = 100_000  # hashes remembered


class PrefixAffinity:
    """LRU map from prompt-prefix block hashes to the prefill worker that last served them."""

    def __init__(
        self,
        block_size: int = AFFINITY_BLOCK_SIZE,
        max_blocks: int = AFFINITY_MAX_BLOCKS,
        capacity: int = AFFINITY_CAPACITY,
    ) -> None:
        self.block_size = block_size
        self.max_blocks = max_blocks
        self.capacity = capacity
        self._owner: OrderedDict[bytes, str] = OrderedDict()

    def hashes(self, token_ids: Sequence[int], cache_salt: str = "") -> list[bytes]:
        """The chained hashes of a prompt's leading blocks, as `lookup` and `record` take them
        (under the request's cache salt: a salted prompt shares a worker's cache only with
        prompts of its salt, so only they count as its prefix there)."""
        return block_hashes(token_ids[: self.block_size * self.max_blocks], self.block_size,
                            parent=salt_root(cache_salt))

    def lookup(self, token_ids: Sequence[int], hashes: Sequence[bytes] | None = None) -> tuple[str | None, int]:
        """(address of the worker holding the longest known prefix, its length in blocks);
        `hashes`: the prompt's `hashes`, when the caller has them already."""
        owner, length = None, 0
        for position, block_hash in enumerate(self.hashes(token_ids) if hashes is None else hashes):
            address = self._owner.get(block_hash)
            if address is None:
                break
            owner, length = address, position + 1
        return owner, length

    def record(self, token_ids: Sequence[int], address: str, hashes: Sequence[bytes] | None = None) -> None:
        """Remember that `address` now holds the prompt's leading blocks."""
        for block_hash in self.hashes(token_ids) if hashes is None else hashes:
            self._owner[block_hash] = address
            self._owner.move_to_end(block_hash)
        while len(self._owner) > self.capacity:
            self._owner.popitem(last=False)


def prefill_load(worker: WorkerHandle) -> int:
    """Prompt tokens queued on a prefill worker (its report plus this gateway's calls in flight)."""
    return worker.load.num_queued_prompt_tokens + worker.in_flight_prompt_tokens


def pick_prefill(
    workers: Sequence[WorkerHandle], affinity: PrefixAffinity, prompt_token_ids: Sequence[int],
    hashes: Sequence[bytes] | None = None,
) -> WorkerHandle | None:
    """The prefill worker for a prompt, or None when no worker is in rotation (`hashes`: the
    prompt's `affinity.hashes`, when the caller has them already)."""
    if not workers:
        return None
    least = min(workers, key=prefill_load)
    owner, num_blocks = affinity.lookup(prompt_token_ids, hashes)
    if owner is not None and num_blocks > 0:
        preferred = next((w for w in workers if w.address == owner), None)
        if preferred is not None and prefill_load(preferred) <= prefill_load(least) + AFFINITY_SLACK_TOKENS:
            return preferred
    return least


def decode_load(worker: WorkerHandle) -> int:
    """Requests on a decode worker: running (its report, or this gateway's live count when that
    is higher) plus waiting."""
    return max(worker.in_flight, worker.load.num_running) + worker.load.num_waiting


def pick_decode(workers: Sequence[WorkerHandle], num_blocks_needed: int) -> WorkerHandle | None:
    """The decode worker for a request needing `num_blocks_needed` blocks now, or None."""
    if not workers:
        return None
    roomy = [w for w in workers if w.load.num_total_blocks == 0 or w.load.num_free_blocks >= num_blocks_needed]
    candidates = roomy or list(workers)
    return min(candidates, key=lambda worker: (decode_load(worker), -worker.load.num_free_blocks))
