"""One request's tokens, from its queue on the decode worker's stream to `GenerateChunk`s.

The Attach streams put the request's deltas in its queue, each tagged with its worker request
and that request's sample index (mapped back to the request's sample here), and a
`WorkerLost` after the last delta of a worker request whose worker was lost; the samples of
lost worker requests migrate (`Migrate`) and their stream goes on. Each sample's deltas become
text (`SampleText`), and each batch of ready deltas one chunk — or, when the client asked for
one aggregated answer or a scaling strategy picks among samples, one final chunk. With n > 1,
a sample that a stop string ends here is aborted alone on its worker while the others go on.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from concurrent.futures import Executor
from dataclasses import replace
from itertools import chain

import structlog

from cleave.errors import DeadlineExceeded
from cleave.generation.outputs import FinishReason
from cleave.rpc.types import TopLogprobs, Usage
from cleave.scaling.strategies import Strategy
from services.gateway.attach import WorkerLost
from services.gateway.backend import GenerateChunk, GenerateSpec, SampleOutput
from services.gateway.convert import TokenDelta, token_delta_from_proto
from services.gateway.delta_queue import DeltaQueue
from services.gateway.model import ServedModel
from services.gateway.placement import RunningRequest
from services.gateway.sample_text import SampleText, resolve_mode
from services.gateway.scaling import combine, summary_chunk
from services.gateway.worker_rpc import time_left

log = structlog.get_logger("cleave.gateway")
# Restarts the unfinished samples of lost worker requests elsewhere; returns final deltas of
# the samples that had nothing left to generate.
Migrate = Callable[[list[WorkerLost], list[SampleText]], Awaitable[list[TokenDelta]]]


def merge_outputs(outputs: Sequence[SampleOutput]) -> SampleOutput:
    """Consecutive outputs of one sample as one, joined once (a held sample of 30k tokens
    is not copied again with each of its chunks)."""
    if len(outputs) == 1:
        return outputs[0]
    return replace(
        outputs[-1],
        text="".join(output.text for output in outputs),
        reasoning_text="".join(output.reasoning_text for output in outputs),
        token_ids=tuple(chain.from_iterable(output.token_ids for output in outputs)),
        logprobs=tuple(chain.from_iterable(output.logprobs for output in outputs)),
        tool_calls=tuple(chain.from_iterable(output.tool_calls for output in outputs)),
        finish_reason=next((output.finish_reason for output in reversed(outputs) if output.finish_reason), None),
    )


def expire(spec: GenerateSpec, queue: DeltaQueue) -> asyncio.TimerHandle | None:
    """Queues `DeadlineExceeded` behind the request's deltas when its deadline passes (None
    without one; raises at once when it passed already): one timer a request, where a timeout
    on each wait for a delta cost a task and a timer a token."""
    timeout = time_left(spec.deadline)
    if timeout is None:
        return None
    error = DeadlineExceeded("the request's deadline passed; allow more time or ask for fewer tokens")
    return asyncio.get_running_loop().call_later(timeout, queue.put_nowait, error)


async def next_items(queue: DeltaQueue) -> list:
    """The next queued deltas (at least one, all that are ready)."""
    items = [await queue.get()]
    while not queue.empty():
        items.append(queue.get_nowait())
    return items


async def stream_samples(
    spec: GenerateSpec,
    prompt_ids: list[int],
    num_cached: int,
    running: RunningRequest,
    worker_finished: list[bool],
    *,
    model: ServedModel,
    tag_tokens: dict[int, str],
    migrate: Migrate,
    abort_sample: Callable[[int], None],
    verify_on: Executor | None = None,
    on_end: Callable[[Usage], None] | None = None,
) -> AsyncIterator[GenerateChunk]:
    """The request's chunks until every sample finished; marks `worker_finished[i]` as a
    worker reports sample i finished (the caller aborts the worker requests with a sample
    that is not). `on_end` gets the usage so far when the stream ends, however it ends."""
    mode = resolve_mode(spec.reasoning.mode, model.reasoning)
    texts = [
        SampleText(i, model.tokenizer, prompt_ids, spec.sampling, model.eos_token_ids, model.reasoning,
                   mode, spec.stream.include_token_ids, tag_tokens, model.token_pieces,
                   spec.forced_call or (model.tool_call_format if spec.parse_tool_calls else None),
                   spec.parallel_tool_calls, spec.include_stop_str)
        for i in range(spec.sampling.n)
    ]
    strategy = spec.scaling.strategy
    hold = spec.stream.aggregate or (
        strategy in (Strategy.MAJORITY_VOTE, Strategy.BEST_OF_N)
        and not spec.scaling.return_all_samples
    )
    held: dict[int, list[SampleOutput]] = {}  # with `hold`: each sample's outputs, merged at the end
    stopped_here: set[int] = set()  # samples the gateway ended (stop strings)
    prompt_scores: list[tuple[TopLogprobs, ...]] = []  # sent by a worker, until a chunk carries them
    if spec.sampling.prompt_logprobs is not None and len(prompt_ids) == 1:
        # a one-token prompt has no scores for a worker to send (its token is scored null), but
        # a chunk still carries its ids: completions' echo lists that token
        prompt_scores.append(())
    prompt_ids_due = spec.stream.include_prompt_token_ids  # until the first chunk carried them

    def with_prompt(chunk: GenerateChunk) -> GenerateChunk:
        nonlocal prompt_ids_due
        chunk = with_prompt_scores(chunk, prompt_scores, prompt_ids)
        if prompt_ids_due:
            prompt_ids_due = False
            chunk = replace(chunk, prompt_token_ids=tuple(prompt_ids))
        return chunk

    def usage() -> Usage:
        return Usage(
            prompt_tokens=len(prompt_ids),
            completion_tokens=sum(len(t.token_ids) for t in texts),
            reasoning_tokens=sum(t.num_reasoning_tokens for t in texts),
            cached_prompt_tokens=num_cached,
        )

    def take(delta: TokenDelta, news: dict[int, list[SampleOutput]]) -> None:
        if delta.prompt_logprobs:
            prompt_scores.append(delta.prompt_logprobs)
        if delta.finish_reason is not None:
            worker_finished[delta.sample_index] = True
            if delta.finish_reason is FinishReason.ERROR:
                log.warning("sample failed on the worker", error=delta.error_message)
        text = texts[delta.sample_index]
        output = text.push(delta)
        if output is not None:
            news.setdefault(output.index, []).append(output)
        if text.finished and not worker_finished[text.index] and text.index not in stopped_here:
            # A stop string matched here: the sample stops decoding on its worker now, not
            # when the whole request ends (n = 1: the request is aborted as the stream ends,
            # by the caller).
            stopped_here.add(text.index)
            if len(texts) > 1:
                abort_sample(text.index)

    expiry: asyncio.TimerHandle | None = None
    try:
        expiry = expire(spec, running.queue)
        while not all(t.finished for t in texts):
            news: dict[int, list[SampleOutput]] = {}
            lost: list[WorkerLost] = []
            for item in await next_items(running.queue):
                if isinstance(item, WorkerLost):
                    lost.append(item)  # its worker request's deltas all came before it
                elif isinstance(item, BaseException):
                    raise item
                elif (dropped := running.lost_in_handoff(item)) is not None:
                    lost.append(dropped)
                else:
                    index = running.request_sample(item.request_id, item.sample_index)
                    if index is not None:  # None: a worker request this request left
                        take(token_delta_from_proto(item, index), news)
            if lost:
                for delta in await migrate(lost, texts):
                    take(delta, news)
            if hold:
                for index, outputs in news.items():
                    held.setdefault(index, []).extend(outputs)
            elif news:
                yield with_prompt(GenerateChunk(
                    samples=tuple(merge_outputs(news[i]) for i in sorted(news)),
                    usage=usage() if spec.stream.continuous_usage else None,
                ))
        collected = {index: merge_outputs(outputs) for index, outputs in held.items()}
        final = await final_chunk(spec, texts, collected, usage(), hold, verify_on)
        yield with_prompt(final)
    finally:
        if expiry is not None:
            expiry.cancel()
        if on_end is not None:
            on_end(usage())


def with_prompt_scores(
    chunk: GenerateChunk, pending: list[tuple[TopLogprobs, ...]], prompt_ids: list[int]
) -> GenerateChunk:
    """`chunk` carrying the prompt's scores, if a worker sent them since the last chunk
    (they arrive once per request, with its first tokens)."""
    if not pending:
        return chunk
    scores = pending.pop(0)
    pending.clear()  # a migrated sample's new worker does not score again; be safe if one did
    return replace(chunk, prompt_logprobs=tuple(scores), prompt_token_ids=tuple(prompt_ids))


async def final_chunk(
    spec: GenerateSpec,
    texts: list[SampleText],
    collected: dict[int, SampleOutput],
    usage: Usage,
    hold: bool,
    verify_on: Executor | None = None,
) -> GenerateChunk:
    """The last chunk: usage, held samples, and the scaling strategy's verdict (its
    verifier on `verify_on`'s threads)."""
    strategy = spec.scaling.strategy
    if strategy is Strategy.NONE:
        samples = tuple(collected[i] for i in sorted(collected)) if hold else ()
        return GenerateChunk(samples=samples, usage=usage)
    result = await combine(spec.request_id, spec.scaling, [scored_text(t) for t in texts], verify_on)
    summary = summary_chunk(result)
    samples = []
    for entry in summary.samples:
        shown = hold and (spec.stream.aggregate or entry.index == result.selected_index)
        body = collected.get(entry.index) if shown else None
        base = body if body is not None else SampleOutput(index=entry.index, finish_reason=texts[entry.index].finish_reason)
        samples.append(replace(base, answer=entry.answer, reward=entry.reward, advantage=entry.advantage))
    return replace(summary, samples=tuple(samples), usage=usage)


def scored_text(text: SampleText) -> str:
    """What a verifier sees: the answer, or an unterminated think block (no answer)."""
    if text.answer_parts or not text.reasoning_parts:
        return text.answer_text
    return "<think>" + text.reasoning_text
