"""What a request lost with its decode worker restarts with on another one.

When a decode worker dies, the gateway still holds everything the client has seen: the
original prompt ids and, per sample, the tokens already streamed (`SampleText`). Each
unfinished sample of the request resumes on its own, as a colocated start
(`Start(prefill_locally=true)`, n = 1) on a healthy worker; samples that already finished stay
finished. With n > 1 the samples diverged, so they no longer share a prompt: a request of n
samples becomes up to n worker requests, one per moved sample.

    prompt      = original prompt ids + the sample's tokens already streamed
    max_tokens  = what was left of the original budget (max_tokens, or the context window)
    min_tokens  = what was left of the original minimum (the tokens already streamed count)
    thinking    = budgets less the reasoning tokens already spent (inside the thinking block);
                  none once the block closed; unchanged before it opened
    seed        = the key the sample's seeded stream had reached (`row_key(seed, sample,
                  position)`), so moved samples of one request do not share a stream

The gateway keeps the sample's detokenizer, stop checker and reasoning parser, so the client's
text, stop strings and logprobs continue from the same state; usage keeps counting the whole
generation against the original prompt.

Exact for greedy sampling (the continuation is the argmax of the same context). Not exact:
  - seeded sampling: the per-token random stream is keyed by (seed, sample index, output
    position), and the moved sample restarts as sample 0 at position 0 on the new worker, so
    it continues with a fresh seeded stream from the migration point (reproducible, but not
    the tokens an uninterrupted run would give);
  - frequency / presence penalties count output tokens only; the tokens moved into the prompt
    no longer count (repetition_penalty covers prompt and output, so it is unaffected);
  - thinking budgets of models whose output opens the thinking block themselves
    (`starts_in_reasoning=False`) while the block is open: the new worker sees the start tag
    in the prompt, not in its output, so it cannot enforce a budget there.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from cleave.generation.reasoning import Phase, ReasoningConfig
from cleave.generation.sampling_params import SamplingParams
from cleave.generation.seed_keys import row_key
from cleave.rpc.types import ReasoningOptions


@dataclass(frozen=True)
class Continuation:
    """A migrated sample's restart: the prompt and limits to start it with elsewhere."""

    prompt_token_ids: list[int]
    sampling: SamplingParams
    reasoning: ReasoningOptions


def remaining_tokens(params: SamplingParams, max_model_len: int, num_prompt_tokens: int, num_generated: int) -> int:
    """Tokens the sample may still generate (<= 0: its budget is spent)."""
    return params.max_new_tokens(max_model_len, num_prompt_tokens) - num_generated


def thinking_budgets(
    options: ReasoningOptions,
    phase: Phase | None,
    num_reasoning_tokens: int,
    reasoning: ReasoningConfig | None,
) -> ReasoningOptions:
    """The thinking budgets left after `num_reasoning_tokens` were spent in `phase`."""
    if reasoning is None or phase is None or phase is Phase.BEFORE:
        return options
    if phase is Phase.ANSWER:
        return replace(options, max_thinking_tokens=None, min_thinking_tokens=None)
    if not reasoning.starts_in_reasoning:
        return options  # unenforceable on the new worker (module docstring)

    def left(budget: int | None) -> int | None:
        return None if budget is None else max(budget - num_reasoning_tokens, 0)

    return replace(
        options,
        max_thinking_tokens=left(options.max_thinking_tokens),
        min_thinking_tokens=left(options.min_thinking_tokens),
    )


def continuation(
    prompt_token_ids: Sequence[int],
    generated_token_ids: Sequence[int],
    params: SamplingParams,
    options: ReasoningOptions,
    *,
    phase: Phase | None,
    num_reasoning_tokens: int,
    reasoning: ReasoningConfig | None,
    max_model_len: int,
    sample_index: int = 0,
) -> Continuation | None:
    """How one sample continues elsewhere (as a request of its own, n = 1); None when it has
    nothing left to generate.

    Args:
        prompt_token_ids: the request's original prompt.
        generated_token_ids: the sample's tokens the gateway received so far.
        params / options: the request's resolved sampling params and reasoning options.
        phase / num_reasoning_tokens: the gateway's reasoning parser state of the sample.
        reasoning: the model's think tags (None for a plain model).
        max_model_len: the model's context window.
        sample_index: the sample's index in its request (keys its seeded stream).
    """
    left = remaining_tokens(params, max_model_len, len(prompt_token_ids), len(generated_token_ids))
    if left <= 0:
        return None
    budgets = thinking_budgets(options, phase, num_reasoning_tokens, reasoning)
    sampling = replace(
        params,
        n=1,
        prompt_logprobs=None,  # the client has the prompt's scores; the new prompt holds output too
        seed=None if params.seed is None else row_key(params.seed, sample_index, len(generated_token_ids)),
        max_tokens=None if params.max_tokens is None else left,
        min_tokens=max(params.min_tokens - len(generated_token_ids), 0),
        max_thinking_tokens=budgets.max_thinking_tokens,
        min_thinking_tokens=budgets.min_thinking_tokens or 0,
    )
    return Continuation(list(prompt_token_ids) + list(generated_token_ids), sampling, budgets)
