"""The KV hand-off of `LLMEngine`: one typed API, `engine.handoff` (a `KVHandoff`), for
everything a worker does with KV blocks that cross the engine's boundary.

The services never touch the engine's `KVCacheManager`: the manager ids that blocks are
kept under (a request's export, its kvstore hold, its first sample's reservation) are
composed here and nowhere else, and block ids go out as plain lists (what transports write).

    prefill worker                              decode worker
    ------------------------------------------  ------------------------------------------
    kvstore: num_cached_blocks(hashes)          reserve(request_id, num_prompt_tokens)
             hold_prefix -> fill -> publish_hold    -> block ids the transport fills
    add_request(..., prefill_only=True)         receive(request_id, prompt, first tokens)
    export(request_id) -> block ids to send         -> the engine decodes the samples
    release_export(request_id)                  release(request_id): never received
    release_hold(request_id)                    cached_prefix(prompt): colocated admission
    kvstore put (paired cache):
             hold_cached -> copy -> release_cached
    snapshot(): free / usable blocks (load reports, both sides)

Block ownership: each block a method takes is freed exactly once, by its one owner.
- Export (prefill side): from the step that finishes a prefill-only request its prompt
  blocks belong to the caller until `release_export` (or `LLMEngine.abort`).
- Reservation (decode side): `reserve`'s blocks belong to the caller until `receive`
  returns, from then on to the engine, which frees the samples' blocks when they finish or
  are aborted; a reservation that is never received is freed by `release`.
- kvstore hold (prefill side): `hold_prefix`'s blocks belong to the caller until
  `release_hold`; blocks it published stay in the prefix cache (free but reusable) after.
- kvstore copy (prefill side): `hold_cached`'s pages are held until `release_cached`.
Every release is idempotent (a no-op when nothing is held), so an owner may call it on each
of its exit paths.

Threads: every method runs on the engine's step thread (`AsyncEngine.call`), except the
pure ones (`block_size`, `num_blocks_for`, `block_hashes`) and `snapshot`, which any thread
may call (a snapshot read off the step thread may mix two steps' counts, fine for load).
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import Protocol

from cleave.engine.request import RequestState, SampleState
from cleave.engine.scheduler import Scheduler
from cleave.engine.sequence import Sequence, SequenceStatus
from cleave.errors import InvalidArgument, NotFound
from cleave.generation.sampling_params import SamplingParams
from cleave.kv.block_pool import OutOfBlocksError
from cleave.kv.manager import KVCacheManager
from cleave.kv.prefix_hash import block_hashes, salt_root

# KV manager ids, private to this module: `<request_id><suffix>`; a reservation is the
# first sample's own sequence id (`Sequence.seq_id` of sample 0).
_EXPORT_SUFFIX = "/export"  # a prefill-only request's prompt blocks, until shipped
_HOLD_SUFFIX = "/kvstore"  # blocks fetched from the kvstore, until the prefill has taken them
_COPY_SUFFIX = "/kvstore-copy"  # cached pages on their way to the kvstore, until copied


def _first_sample_id(request_id: str) -> str:
    return f"{request_id}/0"


@dataclass(frozen=True)
class KVSnapshot:
    """The engine's KV block counts at one moment (what a worker's load report carries)."""

    num_free_blocks: int  # blocks no sequence holds (cached free blocks count as free)
    num_usable_blocks: int  # every block but the null block

    @property
    def num_used_blocks(self) -> int:
        return self.num_usable_blocks - self.num_free_blocks


@dataclass(frozen=True)
class PrefixHold:
    """Blocks `hold_prefix` holds for a prompt's leading full blocks, in prompt order:
    the first `num_cached_blocks` were in the prefix cache already (shared, hold their KV);
    `new_block_ids` follow them and must be filled by the caller before `publish_hold`.
    A paired cache needs the window pages a query after the prefix sees too: those of blocks
    `first_new_window_page` onwards are new (`new_window_page_ids`, to fill as well)."""

    num_cached_blocks: int
    new_block_ids: list[int]
    first_new_window_page: int = 0
    new_window_page_ids: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class CachedPages:
    """A prompt's leading blocks held out of the prefix cache (`hold_cached`): the full
    pages of its first `num_blocks` blocks and, in a paired cache, the window pages a query
    after them sees, those of blocks `first_window_page` .. num_blocks - 1."""

    block_ids: list[int]
    first_window_page: int = 0
    window_page_ids: list[int] = field(default_factory=list)

    @property
    def num_blocks(self) -> int:
        return len(self.block_ids)


class RequestIntake(Protocol):
    """The engine's request bookkeeping that `KVHandoff.receive` admits a request into."""

    def prepare_request(
        self,
        request_id: str,
        prompt: list[int],
        params: SamplingParams | None = None,
        priority: int | None = None,
        arrival_time: float | None = None,
    ) -> RequestState: ...

    def check_new_request(self, request_id: str) -> None: ...

    def track_received(self, state: RequestState, running: bool) -> None: ...


class KVHandoff:
    """The engine's KV hand-off between workers (see the module docstring for the flow,
    the ownership of blocks and threads).

    Args:
        kv: the engine's KV cache manager; only this object touches it for the services.
        scheduler: the engine's scheduler, which received samples join.
        max_model_len: context limit a received sample's first token may already reach.
        requests: the engine's request bookkeeping (`LLMEngine` itself).
    """

    def __init__(self, kv: KVCacheManager, scheduler: Scheduler, max_model_len: int, requests: RequestIntake) -> None:
        self.kv = kv
        self.scheduler = scheduler
        self.max_model_len = max_model_len
        self.requests = requests

    # ---- both sides -----------------------------------------------------------------------

    @property
    def block_size(self) -> int:
        """Tokens per KV block (any thread)."""
        return self.kv.block_size

    def num_blocks_for(self, num_tokens: int) -> int:
        """Blocks that hold `num_tokens` tokens (any thread)."""
        return self.kv.num_blocks_for(num_tokens)

    def num_unseen_pages(self, num_prompt_tokens: int) -> int:
        """Leading entries of a prompt's `export` / `reserve` lists that no later query reads
        (a paired cache's window pages behind the window; else 0): a transfer skips them, as
        it skips blocks the destination has cached (any thread)."""
        return self.kv.num_unseen_pages(num_prompt_tokens)

    def block_hashes(self, token_ids: Seq[int], cache_salt: str = "") -> list[bytes]:
        """Chained hashes of the full blocks of `token_ids` under the engine's KV namespace
        and the request's cache salt: the prefix cache's keys and the kvstore's (any thread)."""
        return block_hashes(token_ids, self.kv.block_size, self.kv.namespace, salt_root(cache_salt))

    @property
    def pairs_window_pages(self) -> bool:
        """Whether a block's KV is two pages, a full page and a window page (a cache that
        pairs window layers: cleave.kv.groups); the kvstore keeps them under two keys."""
        return self.kv.window_group

    def window_page_hashes(self, block_hashes: Seq[bytes]) -> list[bytes]:
        """The window pages' keys of these blocks (a paired cache's; any thread): the prefix
        cache's and the kvstore's."""
        return [self.kv.window_page_hash(block_hash) for block_hash in block_hashes]

    def snapshot(self) -> KVSnapshot:
        """Free and usable block counts now (both sides' `load()`; any thread)."""
        return KVSnapshot(self.kv.num_free_blocks, self.kv.num_usable_blocks)

    def num_cached_blocks(self, hashes: Seq[bytes]) -> int:
        """How many leading `hashes` name blocks a prefix hit would take now (prefill side:
        the kvstore skips what the engine holds; decode side: `cached_prefix`)."""
        return self.kv.num_cached_blocks(hashes)

    # ---- prefill side: the prompt KV of prefill-only requests ----------------------------

    def on_first_token(
        self, state: RequestState, seq: Sequence, sample: SampleState, status: SequenceStatus | None
    ) -> SequenceStatus:
        """Engine only (its sampling callback): a prefill-only sample drew its first token:
        keep the prompt's blocks as the request's export (once per request, whether or not
        the token ends the sample: the decode side has reserved blocks for them either way)
        and end the sequence."""
        sample.flush_text()
        export_id = seq.request_id + _EXPORT_SUFFIX
        if not self.kv.has(export_id):
            # The sequence holds exactly the prompt's slots: its first token has none yet.
            self.kv.fork(seq.seq_id, export_id)
        for other in state.samples:
            if other.num_tokens == 0:
                break
        else:
            state.prefill_done = True  # every sample has its first token (same step)
        return status or SequenceStatus.FINISHED_LENGTH

    def export(self, request_id: str) -> list[int]:
        """Prefill side: block ids holding a finished prefill-only request's prompt KV, in
        token order, to send (a paired cache's: the window table's, then the block table's,
        `KVCacheManager.pages`; the leading `num_unseen_pages` are dropped, null, and never
        sent). The caller owns them until `release_export`. Raises NotFound when the request
        kept none."""
        export_id = request_id + _EXPORT_SUFFIX
        if self.kv.num_unseen_pages(self.kv.num_tokens(export_id)):  # window pages never sent: free them now
            self.kv.drop_outside_window(export_id, self.kv.num_tokens(export_id))
        table = self.kv.pages(export_id)
        if not table:
            raise NotFound(f"no exported prompt KV for request {request_id!r}", field="request_id")
        return table

    def release_export(self, request_id: str) -> None:
        """Prefill side: free the prompt KV a prefill-only request kept, once it is shipped
        (no-op when none is kept)."""
        self.kv.free(request_id + _EXPORT_SUFFIX)

    # ---- prefill side: a kvstore prefix held until the prefill takes it over -------------

    def hold_prefix(self, request_id: str, token_ids: Seq[int], cache_salt: str = "") -> PrefixHold | None:
        """Prefill side (kvstore): hold blocks for `token_ids` (a prompt's leading full
        blocks) under the request's hold; blocks the prefix cache has are shared, the rest
        are new (in a paired cache, new window pages only for the blocks a query after the
        prefix sees). None, with nothing held, when the pool lacks free blocks. The caller
        owns the hold until `release_hold`, also when it fills nothing. `cache_salt`: the
        request's (every method taking tokens hashes them under it)."""
        hold_id = request_id + _HOLD_SUFFIX
        tokens = list(token_ids)
        # + a token: every block may hit
        hit = self.kv.get_computed_blocks(hold_id, tokens + [0], salt_root(cache_salt))
        if not self.kv.allocate_slots(hold_id, len(tokens) - hit.num_computed_tokens, hit):
            self.kv.free(hold_id)
            return None
        num_cached = hit.num_computed_tokens // self.kv.block_size
        new_block_ids = self.kv.block_table(hold_id)[num_cached:]
        if not self.kv.window_group:
            return PrefixHold(num_cached, new_block_ids)
        # Window pages behind the prefix's window go back at once: the new ones among them
        # are never filled, so they must not reach the prefix cache.
        self.kv.drop_outside_window(hold_id, len(tokens))
        first_new = max(num_cached, self.kv.num_unseen_pages(len(tokens)))
        return PrefixHold(num_cached, new_block_ids, first_new, list(self.kv.window_table_view(hold_id)[first_new:]))

    def publish_hold(self, request_id: str, token_ids: Seq[int], cache_salt: str = "") -> None:
        """Prefill side (kvstore): the held blocks for `token_ids` are filled: index them in
        the prefix cache, where the request's prefill (and any other of its salt) finds them."""
        self.kv.cache_full_blocks(request_id + _HOLD_SUFFIX, list(token_ids), root=salt_root(cache_salt))

    def release_hold(self, request_id: str) -> None:
        """Prefill side (kvstore): let go of the request's hold after its prefill (no-op
        when none); published blocks stay cached."""
        self.kv.free(request_id + _HOLD_SUFFIX)

    def hold_cached(self, request_id: str, token_ids: Seq[int], cache_salt: str = "") -> CachedPages:
        """Prefill side (kvstore put): hold the pages of the longest prefix of `token_ids`
        (whole blocks) that a prefix hit would take now, so that a copy may read them beside
        the engine's steps: its full pages and, in a paired cache, the window pages in view
        after it (which the prompt's own table dropped as its prefill moved on, but the
        prefix cache kept). Empty when nothing is cached. Held until `release_cached`."""
        copy_id = request_id + _COPY_SUFFIX
        tokens = list(token_ids)
        # + a token: every block may hit
        hit = self.kv.get_computed_blocks(copy_id, tokens + [0], salt_root(cache_salt))
        if not hit.block_ids or not self.kv.allocate_slots(copy_id, 0, hit):
            self.kv.free(copy_id)  # forgets the lookup's hashes
            return CachedPages([])
        first_window_page = self.kv.num_unseen_pages(hit.num_computed_tokens)
        return CachedPages(list(hit.block_ids), first_window_page, list(hit.window_block_ids[first_window_page:]))

    def release_cached(self, request_id: str) -> None:
        """Prefill side (kvstore put): let go of `hold_cached`'s pages (no-op when none)."""
        self.kv.free(request_id + _COPY_SUFFIX)

    # ---- decode side: a prompt computed elsewhere -----------------------------------------

    def reserve(self, request_id: str, num_prompt_tokens: int, priority: int | None = None) -> list[int]:
        """Decode side: allocate the blocks a prompt's KV arrives in (once, whatever the
        request's n); returns their ids, in token order, for the transport. The caller owns
        them until `receive` returns (then the engine does) or `release`. Raises
        OutOfBlocksError (RESOURCE_EXHAUSTED), or InvalidArgument when the request id already
        holds blocks here. A paired cache's pages come as `export`'s.

        With the request's `priority`, also OutOfBlocksError while a preempted sequence of
        that priority or a more urgent one waits to be recomputed: blocks that running
        requests free go to it first. Else every freed block could go to a new arrival, and
        under steady load a preempted sequence (the most recent arrival of the lowest
        priority, usually deep into its output) would wait as long as arrivals keep coming."""
        seq_id = _first_sample_id(request_id)
        if self.kv.has(seq_id):
            raise InvalidArgument(f"{request_id!r} already holds KV blocks on this worker; use a unique id",
                                  field="request_id")
        if priority is not None and (preempted := self.scheduler.num_preempted_ahead_of(priority)):
            raise OutOfBlocksError(f"{preempted} preempted sequences wait to be recomputed before new arrivals")
        return self.kv.reserve(seq_id, num_prompt_tokens)

    def release(self, request_id: str) -> None:
        """Decode side: free a reservation that will not be received (the transfer failed,
        the deadline passed, the request was aborted or `receive` raised); no-op when none."""
        self.kv.release(_first_sample_id(request_id))

    def receive(
        self,
        request_id: str,
        prompt_token_ids: Seq[int],
        first_tokens: int | Seq[int],
        params: SamplingParams | None = None,
        priority: int | None = None,
        arrival_time: float | None = None,
    ) -> RequestState:
        """Decode side: start decoding a request whose prompt KV fills its reservation
        (reserved here if `reserve` was not called); from now on the engine owns its blocks.

        `first_tokens` holds each sample's first token (`params.n` of them; a bare int for
        n = 1), drawn by a prefill-only engine. The samples share the prompt's blocks, as
        samples of a local prefill do: the partly filled last block is copied on a sample's
        first write. First tokens are reported with the next step's outputs, like every later
        one; a sample its first token ends (eos, max_tokens) finishes there. Raises
        InvalidArgument (nothing taken: the reservation is still the caller's).
        """
        tokens = first_token_list(first_tokens)
        state = self.requests.prepare_request(request_id, list(prompt_token_ids), params, priority, arrival_time)
        check_first_tokens(tokens, state.params.n)
        self.requests.check_new_request(request_id)
        self.requests.track_received(state, self._admit(state, tokens))
        return state

    def cached_prefix(self, prompt_token_ids: Seq[int], cache_salt: str = "") -> int:
        """Decode side (colocated admission): leading prompt tokens whose full blocks the
        prefix cache holds now, what the scheduler will reuse unless they are evicted first
        (the last prompt token is always computed; 0 with prefix caching off)."""
        if not self.kv.enable_prefix_caching:
            return 0
        block_size = self.kv.block_size
        usable = (len(prompt_token_ids) - 1) // block_size
        hashes = self.block_hashes(list(prompt_token_ids[: usable * block_size]), cache_salt)
        return self.num_cached_blocks(hashes) * block_size

    def _admit(self, state: RequestState, first_tokens: Seq[int]) -> bool:
        """Share the prompt's blocks among the samples, feed each its first token and queue
        those it does not end; returns whether any sample runs on."""
        leader = state.samples[0].seq
        if not self.kv.has(leader.seq_id):
            self.kv.reserve(leader.seq_id, leader.num_prompt_tokens)
        self.kv.cache_full_blocks(leader.seq_id, leader.all_token_ids, root=leader.hash_root)  # the forks inherit these
        for sample in state.samples[1:]:
            self.kv.fork(leader.seq_id, sample.seq.seq_id)
        running = []
        for sample, token in zip(state.samples, first_tokens):
            seq = sample.seq
            seq.num_computed_tokens = seq.num_prompt_tokens
            seq.append_token(token)
            status = sample.process_token(token)
            if status is None and seq.num_tokens >= self.max_model_len:
                status = SequenceStatus.FINISHED_LENGTH
                sample.end(status)
            if status is None:
                running.append(seq)
            else:
                seq.status = status
                self.kv.release(seq.seq_id)
        for seq in running:
            self.scheduler.add_prefilled(seq)
        return bool(running)


def first_token_list(first_tokens: int | Seq[int]) -> list[int]:
    """Each sample's first token as a list of ints (a bare int for n = 1)."""
    return [int(first_tokens)] if isinstance(first_tokens, int) else [int(t) for t in first_tokens]


def check_first_tokens(tokens: Seq[int], n: int) -> None:
    """Raise InvalidArgument unless there is one first token per sample."""
    if len(tokens) != n:
        raise InvalidArgument(f"needs one first token per sample ({n}), got {len(tokens)}", field="first_tokens")


def end_sample(state: RequestState | None, index: int, scheduler: Scheduler) -> bool:
    """End sample `index` of a request (FINISHED_ABORTED) and free its KV; False for an
    unknown request or sample, or one that already ended."""
    if state is None or not 0 <= index < len(state.samples) or state.samples[index].finished:
        return False
    sample = state.samples[index]
    if not sample.seq.is_finished:
        scheduler.finish(sample.seq.seq_id, SequenceStatus.FINISHED_ABORTED)
    sample.end(SequenceStatus.FINISHED_ABORTED)
    return True
