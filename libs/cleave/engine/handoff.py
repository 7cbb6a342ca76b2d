"""The disaggregation hand-off of `LLMEngine`: prompt KV kept for export on a prefill
worker, reserved and admitted on a decode worker, and the end of a single sample.

`PrefillExport` (prefill side) keeps a prefill-only request's prompt blocks under
`request_id + EXPORT_SUFFIX` once its samples drew their first tokens, until the caller has
shipped them. `PrefilledAdmission` (decode side) reserves blocks for a prompt whose KV
arrives from elsewhere and starts decoding the request's samples from their first tokens.
Both hold explicit references to the engine's KV manager (and scheduler); the engine's
public methods delegate here and keep the request bookkeeping.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

from cleave.engine.request import RequestState, SampleState
from cleave.engine.scheduler import Scheduler
from cleave.engine.sequence import Sequence, SequenceStatus
from cleave.errors import InvalidArgument, NotFound
from cleave.kv.manager import KVCacheManager

EXPORT_SUFFIX = "/export"  # KV manager id holding a prefill-only request's prompt blocks


class PrefillExport:
    """Prefill side: keeps and hands out the prompt KV of prefill-only requests."""

    def __init__(self, kv: KVCacheManager) -> None:
        self.kv = kv

    def on_first_token(
        self, state: RequestState, seq: Sequence, sample: SampleState, status: SequenceStatus | None
    ) -> SequenceStatus:
        """A prefill-only sample drew its first token: keep the prompt's blocks under the
        export id (once per request, whether or not the token ends the sample: the decode
        side has reserved blocks for them either way) and end the sequence."""
        sample.flush_text()
        export_id = seq.request_id + EXPORT_SUFFIX
        if not self.kv.has(export_id):
            # The sequence holds exactly the prompt's slots: its first token has none yet.
            self.kv.fork(seq.seq_id, export_id)
        for other in state.samples:
            if other.num_tokens == 0:
                break
        else:
            state.prefill_done = True  # every sample has its first token (same step)
        return status or SequenceStatus.FINISHED_LENGTH

    def block_table(self, request_id: str) -> list[int]:
        """Block ids holding a finished prefill-only request's prompt KV, in token order."""
        table = self.kv.block_table(request_id + EXPORT_SUFFIX)
        if not table:
            raise NotFound(f"no exported prompt KV for request {request_id!r}", field="request_id")
        return table

    def release(self, request_id: str) -> None:
        """Free the prompt KV a prefill-only request kept (no-op when none is kept)."""
        self.kv.free(request_id + EXPORT_SUFFIX)


class PrefilledAdmission:
    """Decode side: blocks for a prompt computed elsewhere, and its samples' admission."""

    def __init__(self, kv: KVCacheManager, scheduler: Scheduler, max_model_len: int) -> None:
        self.kv = kv
        self.scheduler = scheduler
        self.max_model_len = max_model_len

    def reserve(self, request_id: str, num_prompt_tokens: int) -> list[int]:
        """Allocate the prompt's blocks under the first sample's id; returns their ids.
        Raises OutOfBlocksError (RESOURCE_EXHAUSTED)."""
        return self.kv.reserve(f"{request_id}/0", num_prompt_tokens)

    def admit(self, state: RequestState, first_tokens: Seq[int]) -> bool:
        """Share the prompt's blocks among the samples, feed each its first token and queue
        those it does not end; returns whether any sample runs on."""
        leader = state.samples[0].seq
        if not self.kv.has(leader.seq_id):
            self.kv.reserve(leader.seq_id, leader.num_prompt_tokens)
        self.kv.cache_full_blocks(leader.seq_id, leader.all_token_ids)  # hashes the forks inherit
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
