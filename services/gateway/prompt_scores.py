"""A prompt's scores as vLLM's `prompt_logprobs` response field.

With `prompt_logprobs: k`, vLLM answers one entry per prompt token: null for the first
(nothing precedes it to score it), then {token id (a string, as JSON keys are): {"logprob",
"rank", "decoded_token"}} with the prompt token first and the k most likely tokens at that
position after it, rank 1 first. A prompt token that is among them appears once, where it
came first, as a dict that was given it twice keeps it:

    [null, {"791": {"logprob": -9.1, "rank": 310, "decoded_token": " cat"},
            "279": {"logprob": -1.2, "rank": 1, "decoded_token": " the"}}, ...]

Chat responses carry the list once, at the top level; completions on every choice (each
its own prompt's). A logprob of -inf is sent as -9999.0, as vLLM clamps it: JSON has no
infinity.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from cleave.rpc.types import TokenLogprob, TopLogprobs

MIN_LOGPROB = -9999.0  # what vLLM sends for -inf


def vllm_prompt_logprobs(
    prompt_token_ids: Sequence[int],
    scores: Sequence[TopLogprobs],
    num_top: int,
    token_text: Callable[[int], str],
) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's `prompt_logprobs` of a prompt: `scores` holds one entry per prompt token after
    the first; each position lists at most `num_top` alternatives."""
    if len(scores) != max(len(prompt_token_ids) - 1, 0):
        raise RuntimeError(f"{len(scores)} prompt scores for {len(prompt_token_ids)} prompt tokens")
    entries: list[dict[str, dict[str, Any]] | None] = [None]
    for entry in scores:
        position = {str(entry.sampled.token_id): _logprob(entry.sampled, token_text)}
        for alternative in entry.top[:num_top]:
            position[str(alternative.token_id)] = _logprob(alternative, token_text)
        entries.append(position)
    return entries


def _logprob(token: TokenLogprob, token_text: Callable[[int], str]) -> dict[str, Any]:
    """vLLM's `Logprob` of one token (its rank null where the worker did not rank it)."""
    return {"logprob": max(token.logprob, MIN_LOGPROB), "rank": token.rank or None,
            "decoded_token": token_text(token.token_id)}
