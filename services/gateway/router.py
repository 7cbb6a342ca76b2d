"""`RoutingBackend`: the gateway's serving logic over prefill and decode workers.

One request: check the prompt's size in bytes -> tokenize (in a worker thread unless the
prompt is short, so a long one never stalls the event loop) -> keep the prompt's last tokens
where the request asks (`prompt_truncation`) -> validate -> place it on a
decode worker (`placement`: free blocks, load) -> start it there (`starts`: disaggregated —
one Prefill on a prefill worker picked by load and prefix affinity, which admits and starts
the decode worker itself, its first tokens streamed at once — for any n, the samples
sharing one prefill; colocated — Start(prefill_locally); conditional — per request, by
`disagg_policy`) -> stream it (`request_stream`): tokens arrive on the decode worker's
Attach stream (one message per engine step for all of this gateway's
requests), are demultiplexed to the request's queue, turned into text per sample
(`SampleText`) and streamed as `GenerateChunk`s. `n` samples are one worker request (they
share the prompt's KV); test-time scaling combines them at the end.

A request that ends early — client cancelled, deadline, gateway stop string, error — is
aborted on its decode worker, which frees its KV blocks. With n > 1, a sample that a stop
string ends here is aborted alone (`AbortRequest.sample_index`) while the others go on.

A request whose decode worker is lost (its Attach stream broke, or its health checks went
unanswered) migrates: each of its unfinished samples there restarts as a colocated start
(n = 1) on a healthy worker from the prompt plus that sample's tokens already streamed
(`services.gateway.migration`); samples that already finished stay finished. From then on
the request runs as several worker requests (`placement.RunningRequest`), all feeding its one
queue, and the client's stream goes on without a gap. One loss (or a failed restart) counts
as one migration of the whole request, at most `GatewayOptions.max_migrations`; past that, or
when no healthy worker is left, the request fails with UNAVAILABLE naming the lost worker.

A start waits on workers that may hang rather than fail (stopped, not dead: their
connections stay open). Each of its calls also ends when the pool declares a worker it waits
on lost (`worker_rpc.call_worker`): the prefill worker of a Prefill, which is then retried
like a failed one, or the decode worker it was placed on (a Prefill's target, or a
colocated Start's worker), and the start moves to another decode worker as one migration.
A worker's own call running out of time is that worker failing, retried the same way; the
client sees DEADLINE_EXCEEDED only once its own deadline passed.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
from collections.abc import AsyncIterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Literal

import grpc
import structlog

from cleave.errors import InvalidArgument, Unavailable
from cleave.generation.outputs import FinishReason
from cleave.generation.reasoning_formats import special_tag_tokens
from cleave.proto.cleave.v1 import common_pb2
from cleave.rpc.drain import DrainGate, wait_until
from cleave.tracing import span
from services.gateway.attach import WorkerLost
from services.gateway.backend import GenerateChunk, GenerateSpec, num_samples
from services.gateway.convert import TokenDelta, request_field
from services.gateway.disagg_policy import ConditionalPrefill, DisaggregationPolicy
from services.gateway.migration import Continuation, continuation
from services.gateway.model import ServedModel
from services.gateway.placement import DecodePlacement, RunningRequest, WorkerRequest
from services.gateway.readiness import Routability, unroutable_reason
from services.gateway.request_stream import stream_samples
from services.gateway.route_observer import NO_ROUTE_OBSERVER, RouteObserver
from services.gateway.routing import PrefixAffinity
from services.gateway.sample_text import SampleText
from services.gateway.starts import PrefillFailed, start_colocated, start_disaggregated
from services.gateway.workers import PoolOptions, WorkerHandle, WorkerPool

log = structlog.get_logger("cleave.gateway")
# Prompts up to this many bytes tokenize on the event loop: a thread hop would cost more.
INLINE_TOKENIZE_MAX_BYTES = 1024
TOKENIZE_THREADS = 4
VERIFY_THREADS = 4  # sandboxed verifications running at once, over every request
MAX_PREFILL_RETRIES = 1  # other prefill workers tried after one fails a request's Prefill


@dataclass(frozen=True)
class GatewayOptions:
    """How the gateway uses its workers."""

    gateway_id: str = "gateway-0"
    mode: Literal["disaggregated", "colocated", "conditional"] = "disaggregated"
    store_to_kvstore: bool = True  # prefill workers keep new prompt blocks in the kvstore
    policy: DisaggregationPolicy = DisaggregationPolicy()  # conditional mode: where each request prefills
    pool: PoolOptions = PoolOptions()
    max_migrations: int = 2  # restarts of one request on another decode worker after losing its own
    priorities: bool = False  # requests may set sampling.priority (--scheduling-policy priority)


class RoutingBackend:
    """GatewayBackend over real workers (see the module docstring).

    Args:
        model: the served model (tokenizer, limits, think tags).
        prefill_addresses / decode_addresses: the workers; colocated mode uses decode only.
        options: gateway id, mode, health-check cadence.

    `routability` says whether a request can be routed now and tells its watchers (the
    gateway's gRPC health) at every change of the workers' rotation or Attach streams.
    """

    def __init__(
        self,
        model: ServedModel,
        prefill_addresses: Sequence[str],
        decode_addresses: Sequence[str],
        options: GatewayOptions = GatewayOptions(),
        observer: RouteObserver = NO_ROUTE_OBSERVER,
    ) -> None:
        if not decode_addresses:
            raise ValueError("the gateway needs at least one decode worker (--decode)")
        if options.mode != "colocated" and not prefill_addresses:
            raise ValueError(f"{options.mode} mode needs at least one prefill worker (--prefill)")
        self.model = model
        self.options = options
        self.observer = observer  # hears where requests start and when they move (metrics)
        prefill = prefill_addresses if options.mode != "colocated" else ()
        pool_options = options.pool
        if options.mode == "disaggregated" and len(prefill) < 2:
            # nothing to choose between: a lone prefill worker's load decides nothing here
            pool_options = replace(pool_options, prefill_load_interval_s=0.0)
        self.pool = WorkerPool(
            prefill, decode_addresses, pool_options, on_change=self._on_worker_change, on_lost=self._on_worker_lost
        )
        self.placement = DecodePlacement(self.pool, options.gateway_id, on_stream_closed=self._on_stream_closed)
        self.routability = Routability(self._unroutable_reason)
        self.affinity = PrefixAffinity()
        self.conditional = ConditionalPrefill(options.policy)
        self._tag_tokens = special_tag_tokens(model.tokenizer, model.reasoning)
        self._running: dict[str, RunningRequest] = {}
        self._num_generating = 0  # generate() calls past the drain gate that have not ended
        self.gate = DrainGate(f"gateway {options.gateway_id}")
        self._tokenize_pool = ThreadPoolExecutor(TOKENIZE_THREADS, thread_name_prefix="gateway-tokenize")
        # test-time scaling's verifiers (code runs in sandboxes for up to MAX_CANDIDATE_TIMEOUT_S):
        # threads of their own, so they bound how many sandboxes run at once and never hold
        # the default executor's threads that other off-loop work shares
        self._verify_pool = ThreadPoolExecutor(VERIFY_THREADS, thread_name_prefix="gateway-verify")

    # ---- lifecycle ------------------------------------------------------------------------

    async def start(self) -> None:
        await self.pool.start()
        await self.routability.update()  # when no worker came into rotation, nothing else would

    async def drain(self) -> None:
        """Refuse new requests (gRPC UNAVAILABLE, HTTP 503, both with a retry hint; HTTP
        `/ready` 503), return once every admitted one has ended (`cleave.rpc.Drainable`)."""
        self.gate.close()
        await self.routability.update()
        await wait_until(lambda: self._num_generating == 0)

    async def shutdown(self) -> None:
        for request_id in list(self._running):
            await self.abort(request_id)
        await self.placement.close()
        await self.pool.close()
        self._tokenize_pool.shutdown(wait=False, cancel_futures=True)
        self._verify_pool.shutdown(wait=False, cancel_futures=True)

    def decode_loads(self) -> list[tuple[str, int]]:
        """Each decode worker (in rotation or not) and the requests this gateway streams from it."""
        return [(worker.worker_id, worker.in_flight) for worker in self.pool.of_role("decode", healthy_only=False)]

    async def _on_worker_change(self, worker: WorkerHandle) -> None:
        await self.placement.on_worker_change(worker)
        await self.routability.update()

    async def _on_worker_lost(self, worker: WorkerHandle) -> None:
        # The starts waiting on it, in any role, gave up already (`WorkerHandle.next_loss`);
        # what is left is a decode worker's streaming requests.
        await self.placement.on_worker_lost(worker)
        await self.routability.update()

    async def _on_stream_closed(self, worker: WorkerHandle) -> None:
        await self.routability.update()

    def _unroutable_reason(self) -> str | None:
        if self.gate.is_draining:
            return str(self.gate.error())
        return unroutable_reason(self.options.mode, len(self.pool.of_role("prefill")), len(self.placement.candidates()))

    # ---- requests -------------------------------------------------------------------------

    async def abort(self, request_id: str, sample_index: int | None = None) -> bool:
        running = self._running.get(request_id)
        if running is None:
            return False
        if sample_index is None:
            for part in list(running.parts.values()):
                await self._abort_on_worker(part.decode, part.worker_request_id, None)
            return True
        found = running.part_of(sample_index)
        if found is None:
            return False  # the sample finished and its worker request was left
        part, worker_sample_index = found
        response = await self._abort_on_worker(part.decode, part.worker_request_id, worker_sample_index)
        return response is None or response.found

    @staticmethod
    async def _abort_on_worker(
        decode: WorkerHandle, worker_request_id: str, sample_index: int | None
    ) -> common_pb2.AbortResponse | None:
        """Abort on a worker; None when the worker did not answer."""
        with contextlib.suppress(grpc.RpcError):
            return await decode.stub.Abort(
                common_pb2.AbortRequest(request_id=worker_request_id, sample_index=sample_index), timeout=5.0
            )
        return None

    async def _prepare_off_loop(self, spec: GenerateSpec) -> tuple[list[int], GenerateSpec]:
        """`_prepare` after the prompt's size check; in a worker thread unless all it may render
        is short (a prompt of small content may carry megabytes of tools or earlier calls)."""
        self.model.check_prompt_size(spec.prompt)
        if self.model.renders_short(spec.prompt, INLINE_TOKENIZE_MAX_BYTES):
            return self._prepare(spec)
        # the copied context makes the thread's gateway.tokenize span a child of the request's
        context = contextvars.copy_context()
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._tokenize_pool, context.run, self._prepare, spec)

    def _prepare(self, spec: GenerateSpec) -> tuple[list[int], GenerateSpec]:
        with span("gateway.tokenize", request_id=spec.request_id):
            prompt_ids = self.model.encode(spec.prompt, spec.reasoning)
        if spec.truncation is not None:  # before the context check: a prompt cut to fit passes it
            prompt_ids = spec.truncation.apply(prompt_ids, self.model.max_model_len, spec.sampling)
        sampling = spec.sampling
        samples = num_samples(spec)
        if samples != sampling.n:  # a scaling strategy's samples
            sampling = replace(sampling, n=samples)
        try:
            sampling.validate(self.model.max_model_len, len(prompt_ids), self.model.vocab_size)
        except InvalidArgument as error:
            raise request_field(error) from None
        return prompt_ids, replace(spec, sampling=sampling)

    async def generate(self, spec: GenerateSpec) -> AsyncIterator[GenerateChunk]:
        self.gate.check()
        if spec.sampling.priority and not self.options.priorities:
            raise InvalidArgument("priority scheduling is off on this gateway (--scheduling-policy priority turns "
                                  "it on); leave priority out or 0", field="sampling.priority")
        self._num_generating += 1
        try:
            async with contextlib.aclosing(self._generate(spec)) as chunks:
                async for chunk in chunks:
                    yield chunk
        finally:
            self._num_generating -= 1

    async def _generate(self, spec: GenerateSpec) -> AsyncIterator[GenerateChunk]:
        prompt_ids, spec = await self._prepare_off_loop(spec)
        if spec.request_id in self._running:  # checked after the await, right before the id is taken
            raise InvalidArgument("a request of this id is already running; use a unique id", field="request_id")
        running = self.placement.place(len(prompt_ids), spec.sampling.n)
        self._running[spec.request_id] = running
        worker_finished = [False] * spec.sampling.n

        async def migrate(lost: list[WorkerLost], texts: list[SampleText]) -> list[TokenDelta]:
            return await self._migrate(spec, prompt_ids, running, texts, lost)

        def abort_sample(sample_index: int) -> None:
            found = running.part_of(sample_index)
            if found is not None:
                part, worker_sample_index = found
                self.placement.fire_abort(part.decode, part.worker_request_id, worker_sample_index)

        try:
            num_cached = await self._start_anywhere(spec, prompt_ids, running)
            chunks = stream_samples(
                spec, prompt_ids, num_cached, running, worker_finished,
                model=self.model, tag_tokens=self._tag_tokens, migrate=migrate, abort_sample=abort_sample,
                verify_on=self._verify_pool, on_end=lambda usage: self.observer.ended(spec.request_id, usage),
            )
            async with contextlib.aclosing(chunks):  # closed at once when this one is: its end is reported now
                async for chunk in chunks:
                    yield chunk
        finally:
            self._running.pop(spec.request_id, None)
            self.placement.leave_all(running, finished=lambda index: worker_finished[index])

    async def _start(self, spec: GenerateSpec, prompt_ids: list[int], running: RunningRequest) -> int:
        """Get the request running on its decode worker; returns the cached prompt tokens.

        A prefill worker that fails the call (or is declared lost while the call waits) is
        retried once on another prefill worker in rotation; when that fails too (or there is
        none), the decode worker prefills the prompt itself (the colocated path) before the
        request fails. Each new try runs under a new worker request id
        (`DecodePlacement.renew`)."""
        (part,) = running.parts.values()
        # prefix hashes of the prompt's leading blocks, for prefill affinity and conditional mode alike
        colocated = self.options.mode == "colocated"
        hashes = [] if colocated else self.affinity.hashes(prompt_ids, spec.sampling.cache_salt)
        remote = self._prefills_remotely(part, prompt_ids, hashes)
        self.observer.routed(spec.request_id, remote, part.decode.worker_id)
        if not remote:
            return await start_colocated(self.pool, spec, prompt_ids, part, gateway_id=self.options.gateway_id)
        if not self.pool.of_role("prefill"):
            log.warning("no prefill worker is in rotation; prefilling on the decode worker",
                        request_id=spec.request_id, decode=part.decode.address)
            return await start_colocated(self.pool, spec, prompt_ids, part, gateway_id=self.options.gateway_id)
        failed: list[WorkerHandle] = []
        while True:
            try:
                return await start_disaggregated(
                    self.pool, self.affinity, spec, prompt_ids, part, running.queue,
                    gateway_id=self.options.gateway_id, store_to_kvstore=self.options.store_to_kvstore,
                    hashes=hashes, avoid=failed,
                )
            except PrefillFailed as error:
                failed.append(error.worker)
                part = self.placement.renew(running, part)
                others = [w for w in self.pool.of_role("prefill") if w not in failed]
                if len(failed) > MAX_PREFILL_RETRIES or not others:
                    log.warning("prefill failed; prefilling on the decode worker", request_id=spec.request_id,
                                prefill=error.worker.address, decode=part.decode.address, reason=error.message)
                    return await start_colocated(self.pool, spec, prompt_ids, part,
                                                 gateway_id=self.options.gateway_id)
                log.warning("prefill failed; retrying on another prefill worker", request_id=spec.request_id,
                            prefill=error.worker.address, reason=error.message)

    def _prefills_remotely(self, part: WorkerRequest, prompt_ids: list[int], hashes: list[bytes]) -> bool:
        mode = self.options.mode
        if mode != "conditional":
            return mode == "disaggregated"
        return self.conditional.choose(part.decode, self.pool.of_role("prefill"), prompt_ids, hashes)

    async def _start_anywhere(self, spec: GenerateSpec, prompt_ids: list[int], running: RunningRequest) -> int:
        """`_start`, moved to another decode worker when its own is lost during the start or
        fails it (a prefill worker's Admit there failed or timed out)."""
        while True:
            try:
                return await self._start(spec, prompt_ids, running)
            except Unavailable as error:
                (part,) = running.parts.values()
                decode_failed = error.field == "decode"  # a prefill worker could not reach it or ship the KV
                if part.decode.healthy and part.stream.is_open and not decode_failed:
                    raise  # not the decode worker (no prefill worker, say): moving would not help
                self.placement.leave(running, part, abort=True)
                self.placement.count_move(running, error, self.options.max_migrations)
                self.observer.migrated(spec.request_id)
                moved = self.placement.place_samples(len(prompt_ids), part.sample_indices, running.queue,
                                                     avoid=part.decode)
                running.add(moved)
                log_move(spec.request_id, running, part.decode, moved, error, num_generated=0)

    async def _migrate(
        self,
        spec: GenerateSpec,
        prompt_ids: list[int],
        running: RunningRequest,
        texts: list[SampleText],
        lost: list[WorkerLost],
    ) -> list[TokenDelta]:
        """Restart the unfinished samples of lost worker requests on other workers (see
        `migration`), each from its own tokens, as one migration of the request.

        Returns final deltas of the samples that have nothing left to generate; raises
        Unavailable when the request may not move again or no worker is left.
        """
        # one per worker request still part of the request (a handoff that failed may be
        # reported twice: by its own stream and by the decode worker's ABORT)
        current = list({error.worker_request_id: error for error in lost
                        if error.worker_request_id in running.parts}.values())
        if not current:
            return []  # worker requests the request already left (moved during their start)
        reason: Unavailable = current[0]
        lost_parts = [running.parts[error.worker_request_id] for error in current]
        finals: list[TokenDelta] = []
        pending: list[tuple[int, Continuation, WorkerHandle]] = []
        for part in lost_parts:
            self.placement.leave(running, part, abort=True)  # the worker may still be alive, only unreachable
            for index in part.sample_indices:
                text = texts[index]
                if text.finished:
                    continue  # finished before the loss: stays finished
                resumed = continuation(
                    prompt_ids, text.token_ids, spec.sampling, spec.reasoning,
                    phase=text.reasoning_phase, num_reasoning_tokens=text.num_reasoning_tokens,
                    reasoning=self.model.reasoning, max_model_len=self.model.max_model_len, sample_index=index,
                )
                if resumed is None:
                    finals.append(TokenDelta(sample_index=index, token_ids=(), finish_reason=FinishReason.LENGTH))
                else:
                    pending.append((index, resumed, part.decode))
        while pending:
            self.placement.count_move(running, reason, self.options.max_migrations)
            self.observer.migrated(spec.request_id)
            # Placed first, all at once: no worker left raises before any start is in flight
            # (the request's end leaves those already placed).
            moved: list[WorkerRequest] = []
            for index, resumed, lost_worker in pending:
                part = self.placement.place_samples(len(resumed.prompt_token_ids), (index,), running.queue)
                running.add(part)
                moved.append(part)
                log_move(spec.request_id, running, lost_worker, part, reason, num_generated=len(texts[index].token_ids))
            outcomes = await asyncio.gather(
                *(self._start_moved(spec, resumed, part) for part, (_, resumed, _) in zip(moved, pending)),
                return_exceptions=True,
            )
            for outcome in outcomes:
                if isinstance(outcome, BaseException) and not isinstance(outcome, Unavailable):
                    raise outcome
            failed = [(entry, part, error) for entry, part, error in zip(pending, moved, outcomes) if error is not None]
            for _, part, _ in failed:
                self.placement.leave(running, part, abort=True)
            pending = [entry for entry, _, _ in failed]
            reason = failed[0][2] if failed else reason
        return finals

    async def _start_moved(self, spec: GenerateSpec, resumed: Continuation, part: WorkerRequest) -> None:
        """Start one moved sample (Start(prefill_locally), n = 1) on its new worker."""
        moved_spec = replace(spec, sampling=resumed.sampling, reasoning=resumed.reasoning)
        await start_colocated(self.pool, moved_spec, resumed.prompt_token_ids, part, gateway_id=self.options.gateway_id)


def log_move(
    request_id: str,
    running: RunningRequest,
    lost_worker: WorkerHandle,
    moved: WorkerRequest,
    reason: Exception,
    num_generated: int,
) -> None:
    """One log line per moved worker request."""
    log.warning(
        "request migrated", request_id=request_id, samples=list(moved.sample_indices),
        lost_worker=lost_worker.address, new_worker=moved.decode.address, num_generated=num_generated,
        migration=running.num_migrations, reason=str(reason),
    )
