"""One generation stream: a prompt, the tokens sampled for it so far, and where it stands.

A request asking for n samples becomes n `Sequence`s with the same `request_id` and
`sample_index` 0..n-1; `seq_id` ("<request_id>/<sample_index>") names each one in the KV
cache manager and in every scheduler output.
"""

from __future__ import annotations

import enum
import sys
import time
from collections.abc import Sequence as Seq
from typing import Any


class SequenceStatus(enum.Enum):
    """Lifecycle of a sequence; the FINISHED_* members say why it ended."""

    WAITING = "waiting"  # not yet admitted (or a fork waiting for its prompt's prefill)
    RUNNING = "running"  # holds KV blocks and is scheduled every step it fits
    PREEMPTED = "preempted"  # its blocks were taken back; it waits to be recomputed
    FINISHED_STOPPED = "finished_stopped"  # EOS or a stop sequence
    FINISHED_LENGTH = "finished_length"  # max_tokens or the model's context length
    FINISHED_ABORTED = "finished_aborted"  # cancelled, deadline passed, or rejected

    # Members are singletons compared by identity, so identity hashing is exact; Enum's own
    # __hash__ is a Python call, paid on every `in FINISHED_STATUSES` of the step loop.
    __hash__ = object.__hash__

    @property
    def is_finished(self) -> bool:
        return self in FINISHED_STATUSES


FINISHED_STATUSES = frozenset(
    {SequenceStatus.FINISHED_STOPPED, SequenceStatus.FINISHED_LENGTH, SequenceStatus.FINISHED_ABORTED}
)
# Module-level aliases for the step loop (reading an Enum member off its class costs a lookup
# through the enum's metaclass).
RUNNING = SequenceStatus.RUNNING


class Sequence:
    """Token state of one sample of one request.

    Tokens live in one list (`all_token_ids`: prompt then output) so appending a token and
    slicing the next chunk to feed are O(1) in the sequence length.

    Attributes:
        request_id: the request this sample belongs to.
        seq_id: "<request_id>/<sample_index>".
        sample_index: 0..n-1 within the request.
        sampling_params: the caller's sampling parameters, carried opaquely to the sampler.
        priority: lower number is served first (0 is the default).
        arrival_time: monotonic seconds when the request arrived; FCFS order within a priority.
        status: where it stands (see SequenceStatus).
        num_computed_tokens: leading tokens whose KV is in the cache.
        num_cached_tokens: tokens served from the prefix cache at its latest admission.
        num_preemptions: times its KV was dropped for recompute.
        parent_seq_id: for a sample forked from another one, that sample's seq_id.
        hash_root: the salt root its blocks' prefix hashes chain from (its request's cache
            salt, `cleave.kv.prefix_hash.salt_root`); None: the shared, unsalted chain.
        max_num_tokens: its length (prompt and output) at which it surely ends, where that is
            known in advance (max_tokens or the context; the prompt and one token for a
            prefill-only request), else sys.maxsize. A sequence this long, its last token
            sampled but not yet resolved, is not scheduled again (`Scheduler`).
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: Seq[int],
        sample_index: int = 0,
        sampling_params: Any = None,
        priority: int = 0,
        arrival_time: float | None = None,
        parent_seq_id: str | None = None,
        hash_root: bytes | None = None,
    ) -> None:
        if not prompt_token_ids:
            raise ValueError(f"request {request_id!r} has an empty prompt; send at least one token")
        self.request_id = request_id
        self.sample_index = sample_index
        # Read several times per token in the step loop: a plain attribute, built once (never reassign).
        self.seq_id = f"{request_id}/{sample_index}"
        self.sampling_params = sampling_params
        self.priority = priority
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.parent_seq_id = parent_seq_id
        self.hash_root = hash_root
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(self.all_token_ids)
        self.status = SequenceStatus.WAITING
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0
        self.num_preemptions = 0
        self.max_num_tokens = sys.maxsize

    def limit_output_tokens(self, max_output_tokens: int) -> None:
        """Declare that it ends after at most `max_output_tokens` generated tokens."""
        self.max_num_tokens = self.num_prompt_tokens + max_output_tokens

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.all_token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[self.num_prompt_tokens :]

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - self.num_prompt_tokens

    @property
    def num_uncomputed_tokens(self) -> int:
        """Tokens still to run through the model before the next token can be sampled."""
        return len(self.all_token_ids) - self.num_computed_tokens

    @property
    def last_token_id(self) -> int:
        return self.all_token_ids[-1]

    @property
    def is_finished(self) -> bool:
        return self.status in FINISHED_STATUSES

    def append_token(self, token_id: int) -> None:
        self.all_token_ids.append(token_id)

    def fork(self, sample_index: int, sampling_params: Any = None) -> "Sequence":
        """A new sample of the same request with this sequence's tokens and progress."""
        child = Sequence(
            self.request_id,
            self.all_token_ids,
            sample_index=sample_index,
            sampling_params=self.sampling_params if sampling_params is None else sampling_params,
            priority=self.priority,
            arrival_time=self.arrival_time,
            parent_seq_id=self.seq_id,
            hash_root=self.hash_root,
        )
        child.num_prompt_tokens = self.num_prompt_tokens
        child.num_computed_tokens = self.num_computed_tokens
        child.max_num_tokens = self.max_num_tokens
        child.status = self.status
        return child

    def __repr__(self) -> str:
        return (
            f"Sequence({self.seq_id}, {self.status.value}, prompt={self.num_prompt_tokens}, "
            f"output={self.num_output_tokens}, computed={self.num_computed_tokens})"
        )
