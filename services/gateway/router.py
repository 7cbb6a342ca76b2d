"""`RoutingBackend`: the gateway's serving logic over prefill and decode workers.

One request, disaggregated:   tokenize -> validate -> pick decode (free blocks, load) ->
    Decode.Admit (reserve blocks) -> pick prefill (load, prefix affinity) -> Prefill (KV
    goes straight to the reserved blocks) -> Decode.Start(first tokens).
Colocated (and n > 1):        tokenize -> validate -> pick decode -> Decode.Start(prefill_locally).
Then tokens arrive on the decode worker's Attach stream (one message per engine step for
all of this gateway's requests), are demultiplexed to the request's queue, turned into
text per sample (`SampleText`) and streamed as `GenerateChunk`s. `n` samples are one worker
request (they share the prompt's KV); test-time scaling combines them at the end.

A request that ends early — client cancelled, deadline, gateway stop string, error — is
aborted on its decode worker, which frees its KV blocks. With n > 1, a sample that a stop
string ends here is aborted alone (`AbortRequest.sample_index`) while the others go on.

A request whose decode worker is lost (its Attach stream broke, or its health checks went
unanswered) migrates: it restarts as a colocated start on a healthy worker from its prompt
plus the tokens already streamed (`services.gateway.migration`), at most
`GatewayOptions.max_migrations` times; the client's stream goes on without a gap. Requests
with n > 1 are not migrated (their samples diverged, and one worker request holds them all):
they fail with UNAVAILABLE, as does a request when no healthy worker is left.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import uuid
from collections.abc import AsyncIterator, Awaitable, Sequence
from dataclasses import dataclass, replace
from typing import Literal, TypeVar

import grpc
import structlog

from cleave.engine.outputs import FinishReason
from cleave.errors import (
    CleaveError,
    DeadlineExceeded,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    Unavailable,
)
from cleave.proto.cleave.v1 import common_pb2, decode_pb2, prefill_pb2
from cleave.rpc.convert import reasoning_to_proto, sampling_to_proto
from cleave.rpc.types import Usage
from services.gateway.attach import AttachStream, WorkerLost
from services.gateway.backend import GenerateChunk, GenerateSpec, SampleOutput, ScalingStrategy
from services.gateway.convert import TokenDelta, request_field, token_delta_from_proto
from services.gateway.migration import continuation
from services.gateway.model import ServedModel
from services.gateway.routing import PrefixAffinity, pick_decode, pick_prefill
from services.gateway.sample_text import SampleText, resolve_mode, special_tag_tokens
from services.gateway.scaling import combine, summary_chunk
from services.gateway.workers import PoolOptions, WorkerHandle, WorkerPool

log = structlog.get_logger("cleave.gateway")
T = TypeVar("T")
BLOCK_SIZE_ESTIMATE = 16  # for "does the prompt fit" routing only; workers decide for real
_ERRORS: dict[grpc.StatusCode, type[CleaveError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgument,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ResourceExhausted,
    grpc.StatusCode.NOT_FOUND: NotFound,
    grpc.StatusCode.FAILED_PRECONDITION: FailedPrecondition,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceeded,
}


@dataclass(frozen=True)
class GatewayOptions:
    """How the gateway uses its workers."""

    gateway_id: str = "gateway-0"
    mode: Literal["disaggregated", "colocated"] = "disaggregated"
    store_to_kvstore: bool = True  # prefill workers keep new prompt blocks in the kvstore
    pool: PoolOptions = PoolOptions()
    max_migrations: int = 2  # restarts of one request on another decode worker after losing its own


@dataclass
class _Running:
    """A request in flight: its id on the workers, the decode worker that streams it and the
    queue its deltas arrive in (all three change when it migrates)."""

    worker_request_id: str
    decode: WorkerHandle
    stream: AttachStream
    queue: asyncio.Queue
    num_migrations: int = 0
    attached: bool = True  # registered on `stream` and counted in `decode.in_flight`


def merge_outputs(first: SampleOutput | None, second: SampleOutput) -> SampleOutput:
    """Two consecutive outputs of one sample as one."""
    if first is None:
        return second
    return replace(
        second,
        text=first.text + second.text,
        reasoning_text=first.reasoning_text + second.reasoning_text,
        token_ids=first.token_ids + second.token_ids,
        logprobs=first.logprobs + second.logprobs,
        finish_reason=second.finish_reason or first.finish_reason,
    )


class RoutingBackend:
    """GatewayBackend over real workers (see the module docstring).

    Args:
        model: the served model (tokenizer, limits, think tags).
        prefill_addresses / decode_addresses: the workers; colocated mode uses decode only.
        options: gateway id, mode, health-check cadence.
    """

    def __init__(
        self,
        model: ServedModel,
        prefill_addresses: Sequence[str],
        decode_addresses: Sequence[str],
        options: GatewayOptions = GatewayOptions(),
    ) -> None:
        if not decode_addresses:
            raise ValueError("the gateway needs at least one decode worker (--decode)")
        if options.mode == "disaggregated" and not prefill_addresses:
            raise ValueError("disaggregated mode needs at least one prefill worker (--prefill)")
        self.model = model
        self.options = options
        prefill = prefill_addresses if options.mode == "disaggregated" else ()
        self.pool = WorkerPool(
            prefill, decode_addresses, options.pool, on_change=self._on_worker_change, on_lost=self._on_worker_lost
        )
        self.affinity = PrefixAffinity()
        self._tag_tokens = special_tag_tokens(model.tokenizer, model.reasoning)
        self._streams: dict[str, AttachStream] = {}
        self._running: dict[str, _Running] = {}
        self._background: set[asyncio.Task] = set()

    # ---- lifecycle ------------------------------------------------------------------------

    async def start(self) -> None:
        await self.pool.start()

    async def shutdown(self) -> None:
        for request_id in list(self._running):
            await self.abort(request_id)
        for stream in list(self._streams.values()):
            await stream.close()
        if self._background:
            await asyncio.gather(*self._background, return_exceptions=True)
        await self.pool.close()

    async def _on_worker_change(self, worker: WorkerHandle) -> None:
        if worker.role != "decode" or not worker.healthy:
            return  # a draining worker still streams its running requests
        stream = self._streams.get(worker.address)
        if stream is not None and stream.is_open:
            return
        stream = AttachStream(worker, self.options.gateway_id, on_broken=self._on_stream_broken)
        stream.open()
        self._streams[worker.address] = stream

    async def _on_worker_lost(self, worker: WorkerHandle) -> None:
        stream = self._streams.get(worker.address)
        if worker.role == "decode" and stream is not None:
            stream.fail(f"{worker.failed_checks} health checks unanswered")

    async def _on_stream_broken(self, worker: WorkerHandle) -> None:
        await self.pool.set_healthy(worker, False)

    def _decode_candidates(self) -> list[WorkerHandle]:
        return [
            w for w in self.pool.of_role("decode")
            if (stream := self._streams.get(w.address)) is not None and stream.is_open
        ]

    # ---- requests -------------------------------------------------------------------------

    async def abort(self, request_id: str, sample_index: int | None = None) -> bool:
        running = self._running.get(request_id)
        if running is None:
            return False
        with contextlib.suppress(grpc.RpcError):
            response = await running.decode.stub.Abort(
                common_pb2.AbortRequest(request_id=running.worker_request_id, sample_index=sample_index), timeout=5.0
            )
            if sample_index is not None:
                return response.found
        return True

    def _fire_abort(self, decode: WorkerHandle, worker_request_id: str, sample_index: int | None = None) -> None:
        """Abort a request (or one of its samples) on its worker without waiting."""

        async def abort() -> None:
            with contextlib.suppress(grpc.RpcError):
                await decode.stub.Abort(
                    common_pb2.AbortRequest(request_id=worker_request_id, sample_index=sample_index), timeout=5.0
                )

        task = asyncio.create_task(abort())
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def _prepare(self, spec: GenerateSpec) -> tuple[list[int], GenerateSpec]:
        prompt_ids = self.model.encode(spec.prompt, spec.reasoning.enable_thinking)
        sampling = spec.sampling
        if spec.scaling.strategy is not ScalingStrategy.NONE:
            sampling = replace(sampling, n=spec.scaling.num_samples)
        try:
            sampling.validate(self.model.max_model_len, len(prompt_ids))
        except InvalidArgument as error:
            raise request_field(error) from None
        return prompt_ids, replace(spec, sampling=sampling)

    async def generate(self, spec: GenerateSpec) -> AsyncIterator[GenerateChunk]:
        if spec.request_id in self._running:
            raise InvalidArgument(f"{spec.request_id!r} is already running; use a unique id", field="request_id")
        prompt_ids, spec = self._prepare(spec)
        running = self._place(len(prompt_ids))
        self._running[spec.request_id] = running
        worker_finished = [False] * spec.sampling.n
        try:
            num_cached = await self._start_anywhere(spec, prompt_ids, running)
            async for chunk in self._stream(spec, prompt_ids, num_cached, running, worker_finished):
                yield chunk
        finally:
            self._running.pop(spec.request_id, None)
            self._leave(running, abort=not all(worker_finished))

    def _place(self, num_prompt_tokens: int) -> _Running:
        """Pick a decode worker and register a queue on its stream (before any Start)."""
        decode = pick_decode(self._decode_candidates(), math.ceil((num_prompt_tokens + 1) / BLOCK_SIZE_ESTIMATE))
        if decode is None:
            raise Unavailable("no decode worker is in rotation; check the workers' health and retry")
        worker_request_id = f"req-{uuid.uuid4().hex}"
        stream = self._streams[decode.address]
        queue = stream.register(worker_request_id)
        decode.in_flight += 1
        return _Running(worker_request_id, decode, stream, queue)

    def _leave(self, running: _Running, abort: bool) -> None:
        """Stop listening to the request's worker (and abort it there, unless it ended)."""
        if not running.attached:
            return
        running.attached = False
        running.stream.unregister(running.worker_request_id)
        running.decode.in_flight -= 1
        if abort:
            self._fire_abort(running.decode, running.worker_request_id)

    async def _migrate(
        self, spec: GenerateSpec, prompt_ids: list[int], running: _Running, text: SampleText, lost: WorkerLost
    ) -> TokenDelta | None:
        """Restart a request whose worker was lost on another one (see `migration`).

        Returns a final delta when the sample has nothing left to generate; raises
        Unavailable when it cannot move (n > 1, too many migrations, no worker left).
        """
        self._leave(running, abort=True)  # the worker may still be alive, only unreachable
        if spec.sampling.n != 1:
            raise Unavailable(f"{lost}; requests with n > 1 are not migrated, retry the request") from None
        resumed = continuation(
            prompt_ids, text.token_ids, spec.sampling, spec.reasoning,
            phase=text.reasoning_phase, num_reasoning_tokens=text.num_reasoning_tokens,
            reasoning=self.model.reasoning, max_model_len=self.model.max_model_len,
        )
        if resumed is None:
            return TokenDelta(sample_index=0, token_ids=(), finish_reason=FinishReason.LENGTH)
        moved_spec = replace(spec, sampling=resumed.sampling, reasoning=resumed.reasoning)
        while True:
            self._move(spec.request_id, running, len(resumed.prompt_token_ids), lost, len(text.token_ids))
            try:
                await self._start_colocated(moved_spec, resumed.prompt_token_ids, running)
                return None
            except Unavailable as error:
                lost = WorkerLost(str(error))
                self._leave(running, abort=True)

    async def _start_anywhere(self, spec: GenerateSpec, prompt_ids: list[int], running: _Running) -> int:
        """`_start`, moved to another decode worker when its own is lost during the start."""
        while True:
            try:
                return await self._start(spec, prompt_ids, running)
            except Unavailable as error:
                if running.decode.healthy and running.stream.is_open:
                    raise  # not the decode worker (no prefill worker, say): moving would not help
                self._leave(running, abort=True)
                self._move(spec.request_id, running, len(prompt_ids), error, num_generated=0)

    def _move(
        self, request_id: str, running: _Running, num_prompt_tokens: int, reason: CleaveError, num_generated: int
    ) -> None:
        """Point a detached request at a new decode worker (raises Unavailable when it may
        not move again or no worker is left)."""
        if running.num_migrations >= self.options.max_migrations:
            raise Unavailable(f"{reason}; the request already moved {running.num_migrations} time(s), retry it")
        moved = self._place(num_prompt_tokens)
        log.warning(
            "request migrated", request_id=request_id, lost_worker=running.decode.address,
            new_worker=moved.decode.address, num_generated=num_generated,
            migration=running.num_migrations + 1, reason=str(reason),
        )
        running.worker_request_id, running.decode = moved.worker_request_id, moved.decode
        running.stream, running.queue = moved.stream, moved.queue
        running.num_migrations += 1
        running.attached = True

    async def _start(self, spec: GenerateSpec, prompt_ids: list[int], running: _Running) -> int:
        """Get the request running on its decode worker; returns the cached prompt tokens."""
        sampling = sampling_to_proto(spec.sampling)
        reasoning = reasoning_to_proto(spec.reasoning)
        decode = running.decode
        request_id = running.worker_request_id
        # n > 1 too: the prefill worker draws every sample's first token from one prefill and
        # the decode worker's samples share the one prompt reservation.
        if self.options.mode == "colocated":
            return await self._start_colocated(spec, prompt_ids, running)
        prefill = pick_prefill(self.pool.of_role("prefill"), self.affinity, prompt_ids)
        if prefill is None:
            raise Unavailable("no prefill worker is in rotation; check the workers' health and retry")
        admitted = await self._rpc(
            decode.stub.Admit(
                decode_pb2.AdmitRequest(
                    request_id=request_id, prompt_token_ids=prompt_ids, sampling=sampling,
                    gateway_id=self.options.gateway_id, prefill_worker_id=prefill.worker_id,
                ),
                timeout=self._remaining(spec),
            ),
            decode, "Admit",
        )
        prefill.in_flight_prompt_tokens += len(prompt_ids)
        try:
            result = await self._rpc(
                prefill.stub.Prefill(
                    prefill_pb2.PrefillRequest(
                        request_id=request_id, prompt_token_ids=prompt_ids, sampling=sampling,
                        destination=admitted.handle, store_to_kvstore=self.options.store_to_kvstore,
                    ),
                    timeout=self._remaining(spec),
                ),
                prefill, "Prefill",
            )
        finally:
            prefill.in_flight_prompt_tokens -= len(prompt_ids)
        self.affinity.record(prompt_ids, prefill.address)
        await self._rpc(
            decode.stub.Start(
                decode_pb2.StartRequest(
                    request_id=request_id, first_token_ids=result.first_token_ids,
                    first_token_logprobs=result.first_token_logprobs, prompt_token_ids=prompt_ids,
                    sampling=sampling, reasoning=reasoning, gateway_id=self.options.gateway_id,
                ),
                timeout=self._remaining(spec),
            ),
            decode, "Start",
        )
        return result.num_cached_tokens

    async def _start_colocated(self, spec: GenerateSpec, prompt_ids: list[int], running: _Running) -> int:
        """Start(prefill_locally): the decode worker prefills the prompt itself."""
        decode = running.decode
        started = await self._rpc(
            decode.stub.Start(
                decode_pb2.StartRequest(
                    request_id=running.worker_request_id, prefill_locally=True, prompt_token_ids=prompt_ids,
                    sampling=sampling_to_proto(spec.sampling), reasoning=reasoning_to_proto(spec.reasoning),
                    gateway_id=self.options.gateway_id,
                ),
                timeout=self._remaining(spec),
            ),
            decode, "Start",
        )
        return started.num_cached_tokens

    async def _rpc(self, call: Awaitable[T], worker: WorkerHandle, method: str) -> T:
        try:
            return await call
        except grpc.aio.AioRpcError as error:
            where = f"{method} on {worker.role} worker {worker.address}"
            error_type = _ERRORS.get(error.code())
            if error_type is not None:
                raise error_type(f"{where}: {error.details()}") from None
            if error.code() is grpc.StatusCode.UNAVAILABLE:
                await self.pool.set_healthy(worker, False)
            raise Unavailable(f"{where} failed ({error.code().name}: {error.details()}); retry") from None

    @staticmethod
    def _remaining(spec: GenerateSpec) -> float | None:
        if spec.deadline is None:
            return None
        remaining = spec.deadline - asyncio.get_running_loop().time()
        if remaining <= 0:
            raise DeadlineExceeded("the request's deadline passed; allow more time or ask for fewer tokens")
        return remaining

    async def _next(self, spec: GenerateSpec, queue: asyncio.Queue) -> list:
        """The next queued deltas (at least one, all that are ready)."""
        try:
            first = await asyncio.wait_for(queue.get(), self._remaining(spec))
        except asyncio.TimeoutError:
            raise DeadlineExceeded(
                "the request's deadline passed; allow more time or ask for fewer tokens"
            ) from None
        items = [first]
        while not queue.empty():
            items.append(queue.get_nowait())
        return items

    async def _stream(
        self,
        spec: GenerateSpec,
        prompt_ids: list[int],
        num_cached: int,
        running: _Running,
        worker_finished: list[bool],
    ) -> AsyncIterator[GenerateChunk]:
        model = self.model
        mode = resolve_mode(spec.reasoning.mode, model.reasoning)
        texts = [
            SampleText(i, model.tokenizer, prompt_ids, spec.sampling, model.eos_token_ids, model.reasoning,
                       mode, spec.stream.include_token_ids, self._tag_tokens)
            for i in range(spec.sampling.n)
        ]
        strategy = spec.scaling.strategy
        hold = spec.stream.aggregate or (
            strategy in (ScalingStrategy.MAJORITY_VOTE, ScalingStrategy.BEST_OF_N)
            and not spec.scaling.return_all_samples
        )
        collected: dict[int, SampleOutput] = {}
        stopped_here: set[int] = set()  # samples the gateway ended (stop strings)

        def usage() -> Usage:
            return Usage(
                prompt_tokens=len(prompt_ids),
                completion_tokens=sum(len(t.token_ids) for t in texts),
                reasoning_tokens=sum(t.num_reasoning_tokens for t in texts),
                cached_prompt_tokens=num_cached,
            )

        while not all(t.finished for t in texts):
            news: dict[int, SampleOutput] = {}
            for item in await self._next(spec, running.queue):
                if isinstance(item, WorkerLost):  # always the last item of its queue
                    final = await self._migrate(spec, prompt_ids, running, texts[0], item)
                    if final is None:
                        continue
                    delta = final
                elif isinstance(item, BaseException):
                    raise item
                else:
                    delta = token_delta_from_proto(item)
                if delta.sample_index >= len(texts):
                    continue
                if delta.finish_reason is not None:
                    worker_finished[delta.sample_index] = True
                    if delta.finish_reason is FinishReason.ERROR:
                        log.warning("sample failed on the worker", error=delta.error_message)
                text = texts[delta.sample_index]
                output = text.push(delta)
                if output is not None:
                    news[output.index] = merge_outputs(news.get(output.index), output)
                if text.finished and not worker_finished[text.index] and text.index not in stopped_here:
                    # A stop string matched here: the sample stops decoding on its worker now,
                    # not when the whole request ends (n = 1: the request is aborted as the
                    # stream ends, below in `generate`).
                    stopped_here.add(text.index)
                    if len(texts) > 1:
                        self._fire_abort(running.decode, running.worker_request_id, text.index)
            for index, output in news.items():
                collected[index] = merge_outputs(collected.get(index), output)
            if news and not hold:
                yield GenerateChunk(
                    samples=tuple(news[i] for i in sorted(news)),
                    usage=usage() if spec.stream.continuous_usage else None,
                )
        yield await self._final_chunk(spec, texts, collected, usage(), hold)

    async def _final_chunk(
        self,
        spec: GenerateSpec,
        texts: list[SampleText],
        collected: dict[int, SampleOutput],
        usage: Usage,
        hold: bool,
    ) -> GenerateChunk:
        strategy = spec.scaling.strategy
        if strategy is ScalingStrategy.NONE:
            samples = tuple(collected[i] for i in sorted(collected)) if hold else ()
            return GenerateChunk(samples=samples, usage=usage)
        result = await combine(spec.request_id, spec.scaling, [_scored_text(t) for t in texts])
        summary = summary_chunk(result)
        samples = []
        for entry in summary.samples:
            shown = hold and (spec.stream.aggregate or entry.index == result.selected_index)
            body = collected.get(entry.index) if shown else None
            base = body if body is not None else SampleOutput(index=entry.index, finish_reason=texts[entry.index].finish_reason)
            samples.append(replace(base, answer=entry.answer, reward=entry.reward, advantage=entry.advantage))
        return replace(summary, samples=tuple(samples), usage=usage)


def _scored_text(text: SampleText) -> str:
    """What a verifier sees: the answer, or an unterminated think block (no answer)."""
    if text.answer_parts or not text.reasoning_parts:
        return text.answer_text
    return "<think>" + text.reasoning_text

