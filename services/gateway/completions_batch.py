"""`/v1/completions` with a list of prompts, or with `echo`: the shape lm-eval's harness sends.

Every prompt runs as its own request, all at once; choice `i * n + j` is sample j of prompt
i, as vLLM numbers them, and usage is the sum. With `echo` each choice's text starts with its
prompt, and with `logprobs` its logprobs start with the prompt's tokens (the first scored
null: nothing precedes it), then the generated ones, as vLLM answers:

    {"prompt": "The cat sat", "echo": true, "max_tokens": 0, "logprobs": 1}
    -> logprobs.tokens ["The", " cat", " sat"], token_logprobs [null, -3.1, -2.4]

`max_tokens: 0` with `echo` leaves the sampled token out (the engine samples at least one),
so the answer scores the prompt alone. The echoed prompt is scored with `prompt_logprobs`'
count where the body sent one, else with `logprobs`', as vLLM does; and each choice then
carries vLLM's `prompt_logprobs` field too (`prompt_scores`), as vLLM's do. Such a request answers whole: a stream of several
prompts or of an echo is a 400 naming `stream`.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import Callable, Sequence
from dataclasses import fields, replace
from typing import Any, Protocol

from cleave.errors import InvalidArgument
from cleave.rpc.types import TopLogprobs, Usage
from services.gateway.backend import GatewayBackend, GenerateChunk, GenerateSpec, Prompt
from services.gateway.openai_request import CompletionEcho, generate_spec


class ChoiceShaper(Protocol):
    """Folds one request's chunks into its OpenAI completion (`http_api._Shaper`)."""

    usage: Usage
    prompt_logprobs: tuple[TopLogprobs, ...]
    prompt_token_ids: tuple[int, ...]

    def add(self, chunk: GenerateChunk) -> None: ...

    def complete(self) -> dict[str, Any]: ...


async def complete_batch(
    backend: GatewayBackend,
    body: dict[str, Any],
    request_id: str,
    model: str,
    prompts: list[Prompt],
    shaper_for: Callable[[GenerateSpec], ChoiceShaper],
    prompt_text: Callable[[Prompt], str],
    token_text: Callable[[int], str],
) -> tuple[dict[str, Any], Usage]:
    """The whole `text_completion` answer for `prompts` (one or more) of one body, and its
    usage summed over them (the caller shapes it into the answer)."""
    echo = CompletionEcho.of(body)
    if body.get("stream"):
        raise InvalidArgument("a list of prompts or echo is answered whole; send stream: false", field="stream")
    specs = [replace(generate_spec(body, f"{request_id}-{position}", model, False, prompt)[0], batch_size=len(prompts))
             for position, prompt in enumerate(prompts)]
    shapers = [shaper_for(spec) for spec in specs]

    async def run(spec: GenerateSpec, shaper: ChoiceShaper) -> None:
        chunks = backend.generate(spec)
        async with contextlib.aclosing(chunks):
            async for chunk in chunks:
                shaper.add(chunk)

    tasks = [asyncio.ensure_future(run(spec, shaper)) for spec, shaper in zip(specs, shapers)]
    try:
        await asyncio.gather(*tasks)
    finally:  # one failed (or the client left): stop the others
        for task in tasks:
            task.cancel()
    choices: list[dict[str, Any]] = []
    totals = {field.name: 0 for field in fields(Usage)}
    for position, (prompt, spec, shaper) in enumerate(zip(prompts, specs, shapers)):
        prefix = prompt_text(prompt) if echo.echo else ""
        for choice in shaper.complete()["choices"]:
            if echo.prompt_only:
                choice.update(text="", finish_reason="length",
                              logprobs=None if choice["logprobs"] is None else _no_logprobs())
                if "token_ids" in choice:  # return_token_ids: the sampled token was left out
                    choice["token_ids"] = []
            if echo.echo and choice["logprobs"] is not None:
                prompt_part = prompt_logprobs(shaper.prompt_token_ids, shaper.prompt_logprobs, token_text,
                                              spec.sampling.logprobs or 0)
                choice["logprobs"] = joined(prompt_part, choice["logprobs"], len(prefix))
            choice["text"] = prefix + choice["text"]
            choice["index"] = position * spec.sampling.n + choice["index"]
            choices.append(choice)
        for name in totals:
            totals[name] += getattr(shaper.usage, name)
    if echo.prompt_only:
        totals["completion_tokens"] = totals["reasoning_tokens"] = 0
    return {**shapers[0].complete(), "id": request_id, "choices": choices}, Usage(**totals)


def _no_logprobs() -> dict[str, list[Any]]:
    return {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}


def prompt_logprobs(
    prompt_token_ids: Sequence[int], scores: Sequence[TopLogprobs], token_text: Callable[[int], str], num_top: int
) -> dict[str, list[Any]]:
    """OpenAI completions logprobs of a prompt: its first token scored null, the others by
    `scores` (one per prompt token after the first), each with at most `num_top` alternatives
    (the prompt was scored with `prompt_logprobs`' count where one was sent, as vLLM does)."""
    if len(scores) != max(len(prompt_token_ids) - 1, 0):
        raise RuntimeError(f"{len(scores)} prompt scores for {len(prompt_token_ids)} prompt tokens")
    tokens = [token_text(token_id) for token_id in prompt_token_ids]
    return {
        "tokens": tokens,
        "token_logprobs": [None, *(entry.sampled.logprob for entry in scores)][: len(tokens)],
        "top_logprobs": [None, *({token_text(t.token_id): t.logprob for t in entry.top[:num_top]} for entry in scores)][
            : len(tokens)],
        "text_offset": list(itertools.accumulate((len(token) for token in tokens[:-1]), initial=0)) if tokens else [],
    }


def joined(prompt_part: dict[str, list[Any]], generated: dict[str, list[Any]], prompt_chars: int) -> dict[str, list[Any]]:
    """Prompt logprobs followed by the generated ones (their offsets moved past the prompt)."""
    return {
        "tokens": prompt_part["tokens"] + generated["tokens"],
        "token_logprobs": prompt_part["token_logprobs"] + generated["token_logprobs"],
        "top_logprobs": prompt_part["top_logprobs"] + generated["top_logprobs"],
        "text_offset": prompt_part["text_offset"] + [prompt_chars + offset for offset in generated["text_offset"]],
    }
