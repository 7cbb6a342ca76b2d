"""How many parts a prompt may hold, counted before any of them is converted (both APIs).

A request's lists may hold millions of tiny elements within the body or message limit (32 MB
is a million empty chat turns). Both front doors convert a request on the gateway's event
loop, one element at a time, where every other client's stream waits; a million turns took
seconds there, only for the prompt to be refused once tokenized as too long for the context.
So the lists are counted first. Each chat turn, earlier tool call and prompt token id takes a
token of the context at least, so as many as the model's context is refused before the first
is read: no answer would fit beside them.

With `truncate_prompt_tokens` (`prompt_truncation`) a prompt may be longer than the context:
- token ids: only the last `max_context_length - 1` are read, the most any truncation keeps
  (`PromptTruncation.apply` refuses a count past what the context holds beside the answer);
  the ids before them are dropped unread, as vLLM drops them, so a prompt's raw length costs
  nothing more than the bytes that carried it (the body or message size bound);
- chat turns and tool calls keep the bound: each renders to a token at least, so all but the
  last context's worth of them would be cut whole anyway. The client can leave them out and
  get the same kept tokens; reading them could hold the loop for seconds.
"""

from __future__ import annotations

from collections.abc import Sequence

from cleave.errors import InvalidArgument
from cleave.generation.sampling_params import check_prompt_fits


def within_context(count: int, max_context_length: int, field: str, what: str) -> None:
    """Refuse `count` parts of a prompt (`what` names them and says why each takes a token)
    that leave no room for an answer in a context of `max_context_length` tokens (0: unknown,
    nothing refused)."""
    if max_context_length and count >= max_context_length:
        raise InvalidArgument(f"holds {count} {what}, but this model's context is {max_context_length} tokens; "
                              "shorten the prompt", field=field)


def token_ids_to_read(ids: Sequence[int], max_context_length: int, truncating: bool, field: str) -> Sequence[int]:
    """The ids of a token-id prompt worth converting (a slice; the sequence itself when all
    are): all of them, refused naming `field` when they fill the context; with truncation, the
    last `max_context_length - 1`. `max_context_length` 0 (unknown): all, unchecked."""
    if not max_context_length:
        return ids
    if not truncating:
        check_prompt_fits(len(ids), max_context_length, field=field)
        return ids
    most_kept = max(max_context_length - 1, 1)
    return ids if len(ids) <= most_kept else ids[len(ids) - most_kept:]
