"""Per-sequence block tables over one BlockPool: prefix hits, growth, forks, copy-on-write.

The scheduler talks to the KV cache only through `KVCacheManager`, keyed by sequence id:

    hit = kv.get_computed_blocks(seq_id, token_ids)       # longest cached prefix (no side effects)
    kv.allocate_slots(seq_id, num_new_tokens, hit)          # False -> nothing changed, preempt
    ... runner applies kv.take_pending_copies(), then writes the new tokens' KV ...
    kv.cache_full_blocks(seq_id, token_ids, num_computed)   # index blocks that became full
    kv.fork(parent_id, child_id)                            # n>1 samples share the prompt
    kv.free(seq_id)                                         # finished, aborted or preempted

Copy-on-write: after `fork`, parent and child share every block, including a partially
filled last block. Whichever of them next writes into that shared block gets a fresh block
in its table instead, and the manager queues `(src, dst)`; the runner must copy block `src`
to block `dst` (all layers, K and V) before the step's forward writes new KV. Copies of one
step may be applied in order, or as one gather-then-scatter.

A decode worker in disaggregated mode uses `reserve`/`release`: the same allocation, for
KV that will arrive over the network instead of being computed locally.

Sliding window: when every attention layer reads only the last W keys (`sliding_window`),
`drop_outside_window` releases the blocks no later query can see, so a long generation holds
at most ceil(W / block_size) + 1 blocks. A dropped entry becomes the null block 0 and the table keeps
its length, so position // block_size still indexes it; the dropped entries are always the
table's first `num_dropped` ones. Models with any full-attention layer pass no window and
keep every block.
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

    Unpacks as `(block_ids, num_computed_tokens)`; `num_computed_tokens` is always a
    multiple of the block size and shorter than the looked-up tokens.
    """

    block_ids: list[int]
    num_computed_tokens: int


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
            (then `drop_outside_window` releases blocks behind it); None keeps every block.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        namespace: bytes = b"",
        sliding_window: int | None = None,
    ) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        if sliding_window is not None and sliding_window <= 0:
            raise ValueError(f"sliding_window must be positive or None, got {sliding_window}")
        self.block_size = block_size
        self.sliding_window = sliding_window
        self.enable_prefix_caching = enable_prefix_caching
        self.namespace = namespace
        self.pool = BlockPool(num_blocks)
        self._seqs: dict[SeqId, _SeqBlocks] = {}
        self._pending_copies: list[tuple[int, int]] = []

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
        """Blocks needed to hold `num_tokens` tokens."""
        return -(-num_tokens // self.block_size)

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

    def num_tokens(self, seq_id: SeqId) -> int:
        """Tokens the sequence has slots for."""
        state = self._seqs.get(seq_id)
        return state.num_tokens if state else 0

    def get_computed_blocks(self, seq_id: SeqId, token_ids: Sequence[int]) -> ComputedBlocks:
        """Longest run of cached full blocks that prefixes `token_ids`.

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
        self._extend_hashes(state, token_ids, max_blocks)
        block_ids: list[int] = []
        for block_hash in state.block_hashes[:max_blocks]:
            block_id = self.pool.lookup(block_hash)
            if block_id is None:
                break
            block_ids.append(block_id)
        return ComputedBlocks(block_ids, len(block_ids) * self.block_size)

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
            self.pool.touch(computed_blocks.block_ids)
            state.block_ids.extend(computed_blocks.block_ids)
            state.num_tokens = computed_blocks.num_computed_tokens
            state.num_cached_blocks = len(computed_blocks.block_ids)
        self._grow(state, num_new_tokens)
        return True

    def allocate_decode_slots(self, seq_ids: Sequence[SeqId]) -> list[Sequence[int]] | None:
        """`allocate_slots(seq_id, 1)` for each sequence in order, in one pass (a decode step);
        returns their live block tables (as `block_table_view`), in order.

        One more token needs at most one block per sequence (a new block at a block
        boundary, or a copy-on-write of a shared last block), so this succeeds whenever the
        pool has a free block per sequence; otherwise it returns None with nothing changed.
        """
        if len(seq_ids) > self.pool.num_free_blocks:
            return None
        seqs, block_size, ref_count = self._seqs, self.block_size, self.pool.ref_count
        tables: list[Sequence[int]] = []
        for seq_id in seq_ids:
            state = seqs.get(seq_id)
            if state is None:
                self.allocate_slots(seq_id, 1)
                state = seqs[seq_id]
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
        send; the returned block ids are where the transport writes. Raises OutOfBlocksError
        (RESOURCE_EXHAUSTED) when the blocks are not free. Undo with `release`.
        """
        if seq_id in self._seqs and self._seqs[seq_id].block_ids:
            raise ValueError(f"sequence {seq_id!r} already holds blocks")
        if not self.allocate_slots(seq_id, num_tokens):
            raise OutOfBlocksError(
                f"reserving {num_tokens} tokens needs {self.num_blocks_for(num_tokens)} KV blocks but "
                f"{self.num_free_blocks} are free; route the request to a less loaded decode worker"
            )
        return self.block_table(seq_id)

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
        self.pool.incref(parent.block_ids[parent.num_dropped :])
        self._seqs[child_id] = _SeqBlocks(
            block_ids=list(parent.block_ids),
            num_tokens=parent.num_tokens,
            block_hashes=list(parent.block_hashes),
            num_cached_blocks=parent.num_cached_blocks,
            num_dropped=parent.num_dropped,
        )

    def free(self, seq_id: SeqId) -> None:
        """Drop the sequence's references; cached full blocks stay reusable until evicted."""
        state = self._seqs.pop(seq_id, None)
        if state is None or not state.block_ids:
            return
        held = state.block_ids[state.num_dropped :]
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
        for a sequence whose KV stays here (not one being exported or received).

        The table is replaced, not edited in place, so a holder of the previous table (a
        step already built from it, a reused device copy) can tell it changed by identity.
        """
        window = self.sliding_window
        state = self._seqs.get(seq_id)
        if window is None or state is None:
            return 0
        if first_position > state.num_tokens:
            raise ValueError(
                f"sequence {seq_id!r} has slots for {state.num_tokens} tokens; a query at position "
                f"{first_position} has no KV yet"
            )
        num_unseen = (first_position - window + 1) // self.block_size  # leading blocks out of every window
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

    def cache_full_blocks(self, seq_id: SeqId, token_ids: Sequence[int], num_computed_tokens: int | None = None) -> None:
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
        self._extend_hashes(state, token_ids, num_full)
        for index in range(max(state.num_cached_blocks, state.num_dropped), num_full):
            self.pool.cache_block(state.block_ids[index], state.block_hashes[index])
        state.num_cached_blocks = num_full

    # ---- internals ------------------------------------------------------------------------

    def _extend_hashes(self, state: _SeqBlocks, token_ids: Sequence[int], num_blocks: int) -> None:
        size = self.block_size
        for index in range(len(state.block_hashes), num_blocks):
            parent = state.block_hashes[-1] if state.block_hashes else None
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
        state = self._seqs.get(seq_id) or _SeqBlocks()
        if computed_blocks.block_ids:
            if state.block_ids:
                raise RuntimeError(f"sequence {seq_id!r} already holds blocks; prefix hits apply to the first allocation")
            for block_id in computed_blocks.block_ids:
                if self.pool.block_hash(block_id) is None:
                    raise RuntimeError(f"prefix block {block_id} was evicted since the lookup; look it up again")
            held = len(computed_blocks.block_ids)
            num_tokens = computed_blocks.num_computed_tokens
            # Reviving a free cached block takes it out of the free count.
            revived = sum(1 for block_id in computed_blocks.block_ids if self.pool.ref_count(block_id) == 0)
            return self.num_blocks_for(num_tokens + num_new_tokens) - held + revived
        cow = 1 if num_new_tokens and self._last_block_shared(state) else 0
        return self.num_blocks_for(state.num_tokens + num_new_tokens) - len(state.block_ids) + cow
