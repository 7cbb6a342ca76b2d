"""Per-sequence block tables over one BlockPool: prefix hits, growth, forks, copy-on-write.

The scheduler talks to the KV cache only through `KVCacheManager`, keyed by sequence id:

    hit = kv.get_computed_blocks(seq_id, token_ids, root)       # longest cached prefix (no side effects)
    kv.allocate_slots(seq_id, num_new_tokens, hit)                # False -> nothing changed, preempt
    ... runner applies kv.take_pending_copies(), then writes the new tokens' KV ...
    kv.cache_full_blocks(seq_id, token_ids, num_computed, root)   # index blocks that became full
    kv.fork(parent_id, child_id)                            # n>1 samples share the prompt
    kv.free(seq_id)                                         # finished, aborted or preempted

Copy-on-write: after `fork`, parent and child share every block, including a partially
filled last block. Whichever of them next writes into that shared block gets a fresh block
in its table instead, and the manager queues `(src, dst)`; the runner must copy block `src`
to block `dst` (all layers, K and V) before the step's forward writes new KV. Copies of one
step may be applied in order, or as one gather-then-scatter.

`root` is the sequence's salt root (`cleave.kv.prefix_hash.salt_root` of its request's
cache salt; None without one): its blocks are indexed and looked up under that chain only.

A decode worker in disaggregated mode uses `reserve`/`release`: the same allocation, for
KV that will arrive over the network instead of being computed locally.

Sliding window: when every attention layer reads only the last W keys (`sliding_window`),
`drop_outside_window` releases the blocks no later query can see, so a long generation holds
at most ceil(W / block_size) + 1 blocks. A dropped entry becomes the null block 0 and the table keeps
its length, so position // block_size still indexes it; the dropped entries are always the
table's first `num_dropped` ones.

Window group (`window_group=True`, models that mix full-attention layers with as many layers
sliding over one window, as gpt-oss does): the KV cache tensor pairs them, slot k holding the
k-th full layer's KV in the pages of a sequence's block table and the k-th sliding layer's
in the pages of its second table, its *window table* (`window_table_view`). Both tables grow
together over one pool; `drop_outside_window` drops from the window table only, so a long
generation holds its full layers' blocks plus about W / block_size window pages instead of
twice its blocks. A prefix hit needs the full table's cached pages and the window pages that
the next query can see (indexed under their own hashes). `pages` lists a sequence's pages as
transports move them, window table first: a reservation (`reserve`) drops the window pages
its first query cannot see at once, so `num_unseen_pages(num_tokens)` leading entries of
a prompt's pages never need to be sent.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from cleave.kv.block_pool import NULL_BLOCK_ID, BlockPool, OutOfBlocksError
from cleave.kv.prefix_hash import BlockHash, hash_block

SeqId = str


class ComputedBlocks(NamedTuple):
    """A prefix-cache hit: full cached blocks and the tokens they hold.

    Unpacks as `(block_ids, num_computed_tokens, window_block_ids)`; `num_computed_tokens` is
    always a multiple of the block size and shorter than the looked-up tokens.
    `window_block_ids` (window group only) is the window table's share of the hit, as long as
    `block_ids`: the null block for the leading pages no later query sees, then cached pages.
    """

    block_ids: list[int]
    num_computed_tokens: int
    window_block_ids: tuple[int, ...] = ()


NO_HIT = ComputedBlocks([], 0)


@dataclass
class _SeqBlocks:
    """One sequence's block table and bookkeeping."""

    block_ids: list[int] = field(default_factory=list)
    num_tokens: int = 0  # tokens that have a slot in block_ids
    block_hashes: list[BlockHash] = field(default_factory=list)  # hashes of its full blocks so far
    num_cached_blocks: int = 0  # leading blocks already indexed in the pool
    num_dropped: int = 0  # leading entries released behind a sliding window (now the null block)


class KVCacheManager:
    """Allocates, shares and frees KV blocks for sequences identified by string ids.

    Args:
        num_blocks: blocks in the KV cache tensor, including the null block 0.
        block_size: tokens per block.
        enable_prefix_caching: index full blocks by chained hash and reuse them.
        namespace: model/dtype/layout identity mixed into every hash (see `kv_namespace`).
        sliding_window: W when every attention layer sees only a query's last W positions
            (then `drop_outside_window` releases blocks behind it), or, with `window_group`,
            the window of the layers that read window tables; None keeps every block.
        window_group: give each sequence a window table beside its block table (see above).
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        namespace: bytes = b"",
        sliding_window: int | None = None,
        window_group: bool = False,
    ) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        if sliding_window is not None and sliding_window <= 0:
            raise ValueError(f"sliding_window must be positive or None, got {sliding_window}")
        if window_group and sliding_window is None:
            raise ValueError("a window group needs the sliding window of its layers")
        self.block_size = block_size
        self.sliding_window = sliding_window
        self.enable_prefix_caching = enable_prefix_caching
        self.namespace = namespace
        self.pool = BlockPool(num_blocks)
        self._seqs: dict[SeqId, _SeqBlocks] = {}
        # Window tables (window group only), keyed as _seqs; None without a window group.
        self._windows: dict[SeqId, _SeqBlocks] | None = {} if window_group else None
        self._window_namespace = namespace + b"/window"
        self._pending_copies: list[tuple[int, int]] = []

    @property
    def window_group(self) -> bool:
        """Whether sequences hold window tables beside their block tables."""
        return self._windows is not None

    @property
    def num_groups(self) -> int:
        """Tables per sequence: 2 with a window group, else 1."""
        return 1 if self._windows is None else 2

    # ---- capacity -------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def num_usable_blocks(self) -> int:
        return self.pool.num_usable_blocks

    @property
    def usage(self) -> float:
        """Fraction of usable blocks held by sequences (cached free blocks count as free)."""
        return 1.0 - self.pool.num_free_blocks / self.pool.num_usable_blocks

    def num_blocks_for(self, num_tokens: int) -> int:
        """Blocks (pages, with a window group: both tables') needed to hold `num_tokens` tokens."""
        return self.num_groups * -(-num_tokens // self.block_size)

    # ---- queries --------------------------------------------------------------------------

    def has(self, seq_id: SeqId) -> bool:
        """Whether `seq_id` holds blocks."""
        return seq_id in self._seqs and bool(self._seqs[seq_id].block_ids)

    def block_table(self, seq_id: SeqId) -> list[int]:
        """A copy of the sequence's block ids, in token order (empty if it holds none)."""
        state = self._seqs.get(seq_id)
        return list(state.block_ids) if state else []

    def block_table_view(self, seq_id: SeqId) -> Sequence[int]:
        """The live block table (no copy): read-only, valid until the manager next changes it."""
        state = self._seqs.get(seq_id)
        return state.block_ids if state else ()

    def window_table_view(self, seq_id: SeqId) -> Sequence[int]:
        """The live window table (window group only; as `block_table_view`)."""
        state = self._windows.get(seq_id) if self._windows is not None else None
        return state.block_ids if state else ()

    def pages(self, seq_id: SeqId) -> list[int]:
        """Every page the sequence holds, as transports move them (`transfer_pages`)."""
        return transfer_pages(self.block_table_view(seq_id), self.window_table_view(seq_id))

    def num_unseen_pages(self, num_tokens: int) -> int:
        """Leading entries of a `num_tokens`-token prompt's `pages` that no query after it
        reads: its window table's pages behind the window (0 without a window group)."""
        return self._num_unseen(num_tokens) if self._windows is not None else 0

    def num_tokens(self, seq_id: SeqId) -> int:
        """Tokens the sequence has slots for."""
        state = self._seqs.get(seq_id)
        return state.num_tokens if state else 0

    def get_computed_blocks(
        self, seq_id: SeqId, token_ids: Sequence[int], root: BlockHash | None = None
    ) -> ComputedBlocks:
        """Longest run of cached full blocks that prefixes `token_ids` (hashed from `root`,
        the sequence's salt root).

        At most `len(token_ids) - 1` tokens are reported computed: the last token must run
        through the model to produce logits. Nothing is reserved; pass the result straight to
        `allocate_slots`. The hashes are remembered for `seq_id` until it is freed.
        """
        if not self.enable_prefix_caching or len(token_ids) <= 1:
            return NO_HIT
        state = self._seqs.setdefault(seq_id, _SeqBlocks())
        if state.block_ids:
            raise RuntimeError(f"sequence {seq_id!r} already holds blocks; look up prefixes before allocating")
        max_blocks = (len(token_ids) - 1) // self.block_size
        self._extend_hashes(state, token_ids, max_blocks, root)
        block_ids = self._cached_run(state.block_hashes[:max_blocks])
        if self._windows is not None:
            return self._window_hit(state.block_hashes, block_ids)
        return ComputedBlocks(block_ids, len(block_ids) * self.block_size)

    def num_cached_blocks(self, block_hashes: Sequence[BlockHash]) -> int:
        """How many leading blocks of `block_hashes` a prefix hit would take now (no side
        effects): those cached, and with a window group only as far as their window pages in
        view are cached too."""
        block_ids = self._cached_run(block_hashes)
        if self._windows is not None and block_ids:
            return len(self._window_hit(list(block_hashes), block_ids).block_ids)
        return len(block_ids)

    def _cached_run(self, block_hashes: Sequence[BlockHash]) -> list[int]:
        """The cached blocks of the leading run of `block_hashes` that are all cached."""
        block_ids: list[int] = []
        for block_hash in block_hashes:
            block_id = self.pool.lookup(block_hash)
            if block_id is None:
                break
            block_ids.append(block_id)
        return block_ids

    def _window_hit(self, block_hashes: list[BlockHash], block_ids: list[int]) -> ComputedBlocks:
        """The longest prefix of the full-table hit `block_ids` whose window pages are cached
        too: those a query right after it can see."""
        lookup = self.pool.lookup
        found: dict[int, int | None] = {}  # block index -> its cached window page (each hashed once)
        for num_hit in range(len(block_ids), 0, -1):
            num_unseen = self._num_unseen(num_hit * self.block_size)
            for index in range(num_unseen, num_hit):
                if index not in found:
                    found[index] = lookup(self.window_page_hash(block_hashes[index]))
            pages = [found[index] for index in range(num_unseen, num_hit)]
            if None not in pages:
                window_ids = (NULL_BLOCK_ID,) * num_unseen + tuple(pages)  # type: ignore[arg-type]
                return ComputedBlocks(block_ids[:num_hit], num_hit * self.block_size, window_ids)
        return NO_HIT

    def window_page_hash(self, block_hash: BlockHash) -> BlockHash:
        """The key of a window page: its block's hash, tagged (the pages hold other layers);
        the prefix cache's key, and the kvstore's for paired caches."""
        return hash_block(block_hash, (), self._window_namespace)

    def _num_unseen(self, first_position: int) -> int:
        """Leading blocks that no query at `first_position` or later can see through the window."""
        assert self.sliding_window is not None
        return max(0, (first_position - self.sliding_window + 1) // self.block_size)

    # ---- allocation -----------------------------------------------------------------------

    def can_allocate(self, seq_id: SeqId, num_new_tokens: int, computed_blocks: ComputedBlocks = NO_HIT) -> bool:
        """Whether `allocate_slots` with the same arguments would succeed."""
        return self._num_blocks_needed(seq_id, num_new_tokens, computed_blocks) <= self.pool.num_free_blocks

    def allocate_slots(self, seq_id: SeqId, num_new_tokens: int, computed_blocks: ComputedBlocks = NO_HIT) -> bool:
        """Give the sequence slots for `num_new_tokens` more tokens.

        `computed_blocks` (a prefix hit, first allocation only) is taken over before the new
        tokens, which then start at `computed_blocks.num_computed_tokens`. Returns False, with
        nothing changed, when the pool cannot supply the blocks.
        """
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be >= 0, got {num_new_tokens}")
        if self._num_blocks_needed(seq_id, num_new_tokens, computed_blocks) > self.pool.num_free_blocks:
            return False
        state = self._seqs.get(seq_id)
        if state is None:
            state = self._seqs[seq_id] = _SeqBlocks()
        if computed_blocks.block_ids:
            self._take_hit(state, computed_blocks.block_ids, computed_blocks.num_computed_tokens)
        self._grow(state, num_new_tokens)
        if self._windows is not None:
            window = self._windows.get(seq_id)
            if window is None:
                window = self._windows[seq_id] = _SeqBlocks()
            if computed_blocks.block_ids:
                self._take_hit(window, list(computed_blocks.window_block_ids), computed_blocks.num_computed_tokens)
            self._grow(window, num_new_tokens)
        return True

    def _take_hit(self, state: _SeqBlocks, block_ids: list[int], num_tokens: int) -> None:
        """Start a table with a prefix hit's pages (leading null pages: dropped already)."""
        num_dropped = 0
        while num_dropped < len(block_ids) and block_ids[num_dropped] == NULL_BLOCK_ID:
            num_dropped += 1
        self.pool.touch(block_ids[num_dropped:])
        state.block_ids.extend(block_ids)
        state.num_tokens = num_tokens
        state.num_cached_blocks = len(block_ids)
        state.num_dropped = num_dropped

    def allocate_decode_slots(self, seq_ids: Sequence[SeqId]) -> list[Sequence[int]] | None:
        """`allocate_slots(seq_id, 1)` for each sequence in order, in one pass (a decode step);
        returns their live block tables (as `block_table_view`), in order.

        One more token needs at most one block per sequence (a new block at a block
        boundary, or a copy-on-write of a shared last block), so this succeeds whenever the
        pool has a free block per sequence; otherwise it returns None with nothing changed.
        """
        if len(seq_ids) * self.num_groups > self.pool.num_free_blocks:
            return None
        tables = self._grow_decodes(self._seqs, seq_ids)
        if self._windows is not None:
            self._grow_decodes(self._windows, seq_ids)
        return tables

    def _grow_decodes(self, seqs: dict[SeqId, _SeqBlocks], seq_ids: Sequence[SeqId]) -> list[Sequence[int]]:
        """One more slot in each sequence's table of one group; returns the tables."""
        block_size, ref_count = self.block_size, self.pool.ref_count
        tables: list[Sequence[int]] = []
        for seq_id in seq_ids:
            state = seqs.get(seq_id)
            if state is None:
                state = seqs[seq_id] = _SeqBlocks()
                self._grow(state, 1)
            elif state.num_tokens % block_size and ref_count(state.block_ids[-1]) == 1:
                state.num_tokens += 1  # most decodes: room left in a last block held alone (`_grow`)
            else:
                self._grow(state, 1)
            tables.append(state.block_ids)
        return tables

    def _grow(self, state: _SeqBlocks, num_new_tokens: int) -> None:
        """Slots for `num_new_tokens` more tokens (the caller checked the pool has the blocks):
        a copy of a shared, partly filled last block, then whole new blocks as needed."""
        if num_new_tokens and self._last_block_shared(state):
            self._copy_on_write(state)
        total_tokens = state.num_tokens + num_new_tokens
        num_new_blocks = -(-total_tokens // self.block_size) - len(state.block_ids)
        if num_new_blocks:  # most decode steps write into the last block they hold
            state.block_ids.extend(self.pool.allocate(num_new_blocks))
        state.num_tokens = total_tokens

    def reserve(self, seq_id: SeqId, num_tokens: int) -> list[int]:
        """Allocate a new sequence's blocks for `num_tokens` tokens whose KV arrives remotely.

        Used by a decode worker admitting a request whose prompt KV a prefill worker will
        send; the returned block ids (`pages`) are where the transport writes, but for the
        leading `num_unseen_pages(num_tokens)`: window pages no later query reads, dropped
        at once (null). Raises OutOfBlocksError (RESOURCE_EXHAUSTED) when the blocks are not
        free. Undo with `release`.
        """
        if seq_id in self._seqs and self._seqs[seq_id].block_ids:
            raise ValueError(f"sequence {seq_id!r} already holds blocks")
        if not self.allocate_slots(seq_id, num_tokens):
            raise OutOfBlocksError(
                f"reserving {num_tokens} tokens needs {self.num_blocks_for(num_tokens)} KV blocks but "
                f"{self.num_free_blocks} are free; route the request to a less loaded decode worker"
            )
        if self._windows is not None:
            self.drop_outside_window(seq_id, num_tokens)
        return self.pages(seq_id)

    def release(self, seq_id: SeqId) -> None:
        """Return a reservation's blocks (the transfer failed or the request was cancelled)."""
        self.free(seq_id)

    def fork(self, parent_id: SeqId, child_id: SeqId) -> None:
        """Make `child_id` share every block of `parent_id` (copy-on-write on the next write)."""
        parent = self._seqs.get(parent_id)
        if parent is None or not parent.block_ids:
            raise KeyError(f"cannot fork {parent_id!r}: it holds no blocks")
        if self.has(child_id):
            raise ValueError(f"cannot fork into {child_id!r}: it already holds blocks")
        self._seqs[child_id] = self._share(parent)
        if self._windows is not None:
            self._windows[child_id] = self._share(self._windows[parent_id])

    def _share(self, parent: _SeqBlocks) -> _SeqBlocks:
        """A new reference to every block `parent` holds, as a table of its own."""
        self.pool.incref(parent.block_ids[parent.num_dropped :])
        return _SeqBlocks(
            block_ids=list(parent.block_ids),
            num_tokens=parent.num_tokens,
            block_hashes=list(parent.block_hashes),
            num_cached_blocks=parent.num_cached_blocks,
            num_dropped=parent.num_dropped,
        )

    def free(self, seq_id: SeqId) -> None:
        """Drop the sequence's references; cached full blocks stay reusable until evicted."""
        held: list[int] = []
        for seqs in (self._seqs, self._windows):
            state = seqs.pop(seq_id, None) if seqs is not None else None
            if state is not None:
                held += state.block_ids[state.num_dropped :]
        if not held:
            return
        # Tail first: the end of a sequence is the least likely part to be shared again.
        self.pool.free(reversed(held))
        freed = {block_id for block_id in held if self.pool.ref_count(block_id) == 0}
        if freed and self._pending_copies:
            self._pending_copies = [(src, dst) for src, dst in self._pending_copies if dst not in freed]

    def drop_outside_window(self, seq_id: SeqId, first_position: int) -> int:
        """Release the sequence's blocks that no query at `first_position` or later can see;
        returns how many were dropped (0 without a sliding window).

        A query at position p reads keys p - W + 1 .. p (the attention kernels' and
        transformers' convention), so a block whose every position is below
        `first_position - W + 1` is never read again. Its entry becomes the null block and
        its reference goes back to the pool; a block indexed in the prefix cache stays
        findable there until evicted, like any freed cached block. The caller passes the
        earliest position of any query still to run (a step in flight included), and only
        for a sequence whose KV stays here, or for an export or a reservation at its prompt's
        end (the pages dropped are those `num_unseen_pages` says are never sent).

        The table is replaced, not edited in place, so a holder of the previous table (a
        step already built from it, a reused device copy) can tell it changed by identity.
        """
        seqs = self._seqs if self._windows is None else self._windows
        state = seqs.get(seq_id)
        if self.sliding_window is None or state is None:
            return 0
        if first_position > state.num_tokens:
            raise ValueError(
                f"sequence {seq_id!r} has slots for {state.num_tokens} tokens; a query at position "
                f"{first_position} has no KV yet"
            )
        num_unseen = self._num_unseen(first_position)  # leading blocks out of every window
        start = state.num_dropped
        if num_unseen <= start:
            return 0
        dropped = state.block_ids[start:num_unseen]
        table = list(state.block_ids)
        table[start:num_unseen] = [NULL_BLOCK_ID] * len(dropped)
        state.block_ids = table
        state.num_dropped = num_unseen
        self.pool.free(reversed(dropped))  # the earliest freed last: a prefix hit needs it most
        return len(dropped)

    def take_pending_copies(self) -> list[tuple[int, int]]:
        """Block copies `(src, dst)` the runner must apply before the next forward; clears them."""
        copies, self._pending_copies = self._pending_copies, []
        return copies

    def cache_full_blocks(
        self, seq_id: SeqId, token_ids: Sequence[int], num_computed_tokens: int | None = None,
        root: BlockHash | None = None,
    ) -> None:
        """Index the sequence's blocks that are full of computed KV.

        `token_ids` are the sequence's tokens; only the first `num_computed_tokens` (default:
        all) count as computed.
        """
        if not self.enable_prefix_caching:
            return
        state = self._seqs.get(seq_id)
        if state is None:
            return
        num_computed = len(token_ids) if num_computed_tokens is None else num_computed_tokens
        num_full = min(num_computed, state.num_tokens) // self.block_size
        if num_full <= state.num_cached_blocks:
            return
        self._extend_hashes(state, token_ids, num_full, root)
        for index in range(max(state.num_cached_blocks, state.num_dropped), num_full):
            self.pool.cache_block(state.block_ids[index], state.block_hashes[index])
        state.num_cached_blocks = num_full
        window = self._windows.get(seq_id) if self._windows is not None else None
        if window is not None:
            for index in range(max(window.num_cached_blocks, window.num_dropped), num_full):
                self.pool.cache_block(window.block_ids[index], self.window_page_hash(state.block_hashes[index]))
            window.num_cached_blocks = max(window.num_cached_blocks, num_full)

    # ---- internals ------------------------------------------------------------------------

    def _extend_hashes(
        self, state: _SeqBlocks, token_ids: Sequence[int], num_blocks: int, root: BlockHash | None
    ) -> None:
        size = self.block_size
        for index in range(len(state.block_hashes), num_blocks):
            parent = state.block_hashes[-1] if state.block_hashes else root
            chunk = token_ids[index * size : (index + 1) * size]
            state.block_hashes.append(hash_block(parent, chunk, self.namespace))

    def _last_block_shared(self, state: _SeqBlocks) -> bool:
        return (
            bool(state.block_ids)
            and state.num_tokens % self.block_size != 0
            and self.pool.ref_count(state.block_ids[-1]) > 1
        )

    def _copy_on_write(self, state: _SeqBlocks) -> None:
        src = state.block_ids[-1]
        (dst,) = self.pool.allocate(1)
        self.pool.free([src])
        state.block_ids[-1] = dst
        self._pending_copies.append((src, dst))

    def _num_blocks_needed(self, seq_id: SeqId, num_new_tokens: int, computed_blocks: ComputedBlocks) -> int:
        needed = self._num_table_blocks_needed(self._seqs, seq_id, num_new_tokens, computed_blocks.block_ids,
                                               computed_blocks.num_computed_tokens)
        if self._windows is not None:
            needed += self._num_table_blocks_needed(self._windows, seq_id, num_new_tokens,
                                                    computed_blocks.window_block_ids, computed_blocks.num_computed_tokens)
        return needed

    def _num_table_blocks_needed(
        self, seqs: dict[SeqId, _SeqBlocks], seq_id: SeqId, num_new_tokens: int, hit: Sequence[int], num_hit_tokens: int
    ) -> int:
        """New blocks one table needs for `num_new_tokens` more tokens (after a prefix `hit`)."""
        state = seqs.get(seq_id) or _SeqBlocks()
        if hit:
            if state.block_ids:
                raise RuntimeError(f"sequence {seq_id!r} already holds blocks; prefix hits apply to the first allocation")
            cached = [block_id for block_id in hit if block_id != NULL_BLOCK_ID]
            for block_id in cached:
                if self.pool.block_hash(block_id) is None:
                    raise RuntimeError(f"prefix block {block_id} was evicted since the lookup; look it up again")
            # Reviving a free cached block takes it out of the free count.
            revived = sum(1 for block_id in cached if self.pool.ref_count(block_id) == 0)
            return -(-(num_hit_tokens + num_new_tokens) // self.block_size) - len(hit) + revived
        cow = 1 if num_new_tokens and self._last_block_shared(state) else 0
        return -(-(state.num_tokens + num_new_tokens) // self.block_size) - len(state.block_ids) + cow


def transfer_pages(block_table: Sequence[int], window_table: Sequence[int] = ()) -> list[int]:
    """A sequence's pages as transports move them: its window table (window group), then its
    block table, each in token order; the window table leads so that the pages behind its
    window are a prefix a transfer can skip."""
    return [*window_table, *block_table]
