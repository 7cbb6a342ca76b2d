"""Prompt logprobs: how likely the model found each prompt token, from the prefill forward.

A prefill forward computes hidden states for every prompt position but logits only for the
last (the one that samples). A request with `SamplingParams.prompt_logprobs` also gets logits
for its other positions: position p's logits score prompt token p + 1, so a prompt of P
tokens has P - 1 scores (its first token has none). Scoring a prompt (lm-eval's
loglikelihood) is thus one prefill, chunked or not.

    SchedulerOutput (prefill entries at the end, in batch order)
      -> `prompt_logprob_rows`: which hidden rows score which prompt tokens (host, no tensors)
      -> `score_prompt_rows`: logits of those rows only, log-softmax, the target's logprob and
         rank and the top-k, in sub-chunks so a long prompt never holds [P, V] logits at once
      -> `PromptLogprobChunk` per entry, into `RunnerOutput.prompt_logprobs`

Such requests take no prefix-cache hit (`SchedulerPlanner`): a cached prefix has no hidden
states to score.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from cleave.engine.scheduler_output import SchedulerOutput
from cleave.engine.sequence import Sequence
from cleave.generation.outputs import TokenLogprob

# Rows scored per logits matmul: bounds the [rows, V] float32 logits of one sub-chunk.
SCORE_ROWS_PER_CHUNK = 256


@dataclass(frozen=True)
class PromptRows:
    """Hidden rows [row_start, row_start + len(target_ids)) of one prefill entry that score
    prompt tokens `target_ids`, the first at position `first_position`."""

    seq: Sequence
    row_start: int
    first_position: int
    target_ids: list[int]
    num_top: int


@dataclass(frozen=True)
class PromptLogprobChunk:
    """Logprobs of a sequence's prompt tokens at positions first_position, first_position + 1, ..."""

    seq: Sequence
    first_position: int
    entries: list[TokenLogprob]


def prompt_logprob_rows(output: SchedulerOutput, num_tokens: int) -> list[PromptRows]:
    """The rows to score in a step of `num_tokens` tokens (decodes first, prefills last:
    a decode-only step costs one check)."""
    rows: list[PromptRows] = []
    row_end = num_tokens
    for entry in reversed(output.scheduled):
        if not entry.is_prefill:
            break
        row_start = row_end - entry.num_new_tokens
        row_end = row_start
        num_top = getattr(entry.seq.sampling_params, "prompt_logprobs", None)
        if num_top is None:
            continue
        prompt = entry.seq.prompt_token_ids
        start = entry.start_position
        # position p scores prompt[p + 1]; the prompt's last position samples instead
        stop = min(start + entry.num_new_tokens, len(prompt) - 1)
        if stop > start:
            rows.append(PromptRows(entry.seq, row_start, start + 1, list(prompt[start + 1 : stop + 1]), num_top))
    rows.reverse()
    return rows


def score_prompt_rows(
    hidden: torch.Tensor, rows: list[PromptRows], compute_logits: Callable[[torch.Tensor], torch.Tensor]
) -> list[PromptLogprobChunk]:
    """hidden: [T, H] of the whole step; returns one chunk per `rows` entry (host values)."""
    chunks = []
    for spec in rows:
        entries: list[TokenLogprob] = []
        for offset in range(0, len(spec.target_ids), SCORE_ROWS_PER_CHUNK):
            targets = spec.target_ids[offset : offset + SCORE_ROWS_PER_CHUNK]
            start = spec.row_start + offset
            logits = compute_logits(hidden[start : start + len(targets)])  # [C, V]
            logprobs = torch.log_softmax(logits.float(), dim=-1)
            target_ids = torch.tensor(targets, dtype=torch.int64, device=logprobs.device)
            chosen_values = logprobs.gather(1, target_ids[:, None])  # [C, 1]
            chosen = chosen_values.squeeze(1).tolist()  # [C]
            # vLLM's rank: the tokens at least as likely as the target, the target included
            ranks = (logprobs >= chosen_values).sum(dim=-1).tolist()  # [C]
            if spec.num_top:
                top_values, top_ids = logprobs.topk(spec.num_top, dim=-1)  # [C, K]
                top = zip(top_ids.tolist(), top_values.tolist())
            else:
                top = (([], []) for _ in targets)
            entries.extend(
                TokenLogprob(token_id, logprob, ids, values, rank)
                for token_id, logprob, (ids, values), rank in zip(targets, chosen, top, ranks)
            )
        chunks.append(PromptLogprobChunk(spec.seq, spec.first_position, entries))
    return chunks
