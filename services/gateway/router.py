"""`RoutingBackend`: the gateway's serving logic over prefill and decode workers.

One request: tokenize -> validate -> place it on a decode worker (`placement`: free blocks,
load) -> start it there (`starts`: disaggregated — Admit, Prefill on a prefill worker picked
by load and prefix affinity, Start with the first tokens — for any n, the samples sharing one
prefill; colocated — Start(prefill_locally)) -> stream it (`request_stream`): tokens arrive on
the decode worker's Attach stream (one message per engine step for all of this gateway's
requests), are demultiplexed to the request's queue, turned into text per sample
(`SampleText`) and streamed as `GenerateChunk`s. `n` samples are one worker request (they
share the prompt's KV); test-time scaling combines them at the end.

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

import contextlib
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, replace
from typing import Literal

import grpc

from cleave.engine.outputs import FinishReason
from cleave.errors import InvalidArgument, Unavailable
from cleave.proto.cleave.v1 import common_pb2
from services.gateway.attach import WorkerLost
from services.gateway.backend import GenerateChunk, GenerateSpec, ScalingStrategy
from services.gateway.convert import TokenDelta, request_field
from services.gateway.migration import continuation
from services.gateway.model import ServedModel
from services.gateway.placement import DecodePlacement, RunningRequest
from services.gateway.request_stream import stream_samples
from services.gateway.routing import PrefixAffinity
from services.gateway.sample_text import SampleText, special_tag_tokens
from services.gateway.starts import start_colocated, start_disaggregated
from services.gateway.workers import PoolOptions, WorkerHandle, WorkerPool


@dataclass(frozen=True)
class GatewayOptions:
    """How the gateway uses its workers."""

    gateway_id: str = "gateway-0"
    mode: Literal["disaggregated", "colocated"] = "disaggregated"
    store_to_kvstore: bool = True  # prefill workers keep new prompt blocks in the kvstore
    pool: PoolOptions = PoolOptions()
    max_migrations: int = 2  # restarts of one request on another decode worker after losing its own


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
        self.placement = DecodePlacement(self.pool, options.gateway_id)
        self.affinity = PrefixAffinity()
        self._tag_tokens = special_tag_tokens(model.tokenizer, model.reasoning)
        self._running: dict[str, RunningRequest] = {}

    # ---- lifecycle ------------------------------------------------------------------------

    async def start(self) -> None:
        await self.pool.start()

    async def shutdown(self) -> None:
        for request_id in list(self._running):
            await self.abort(request_id)
        await self.placement.close()
        await self.pool.close()

    async def _on_worker_change(self, worker: WorkerHandle) -> None:
        await self.placement.on_worker_change(worker)

    async def _on_worker_lost(self, worker: WorkerHandle) -> None:
        await self.placement.on_worker_lost(worker)

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
        running = self.placement.place(len(prompt_ids))
        self._running[spec.request_id] = running
        worker_finished = [False] * spec.sampling.n

        async def migrate(text: SampleText, lost: WorkerLost) -> TokenDelta | None:
            return await self._migrate(spec, prompt_ids, running, text, lost)

        def abort_sample(sample_index: int) -> None:
            self.placement.fire_abort(running.decode, running.worker_request_id, sample_index)

        try:
            num_cached = await self._start_anywhere(spec, prompt_ids, running)
            chunks = stream_samples(
                spec, prompt_ids, num_cached, running, worker_finished,
                model=self.model, tag_tokens=self._tag_tokens, migrate=migrate, abort_sample=abort_sample,
            )
            async for chunk in chunks:
                yield chunk
        finally:
            self._running.pop(spec.request_id, None)
            self.placement.leave(running, abort=not all(worker_finished))

    async def _start(self, spec: GenerateSpec, prompt_ids: list[int], running: RunningRequest) -> int:
        """Get the request running on its decode worker; returns the cached prompt tokens."""
        if self.options.mode == "colocated":
            return await start_colocated(self.pool, spec, prompt_ids, running, gateway_id=self.options.gateway_id)
        return await start_disaggregated(
            self.pool, self.affinity, spec, prompt_ids, running,
            gateway_id=self.options.gateway_id, store_to_kvstore=self.options.store_to_kvstore,
        )

    async def _start_anywhere(self, spec: GenerateSpec, prompt_ids: list[int], running: RunningRequest) -> int:
        """`_start`, moved to another decode worker when its own is lost during the start."""
        while True:
            try:
                return await self._start(spec, prompt_ids, running)
            except Unavailable as error:
                if running.decode.healthy and running.stream.is_open:
                    raise  # not the decode worker (no prefill worker, say): moving would not help
                self.placement.leave(running, abort=True)
                self.placement.move(
                    spec.request_id, running, len(prompt_ids), error, num_generated=0,
                    max_migrations=self.options.max_migrations,
                )

    async def _migrate(
        self, spec: GenerateSpec, prompt_ids: list[int], running: RunningRequest, text: SampleText, lost: WorkerLost
    ) -> TokenDelta | None:
        """Restart a request whose worker was lost on another one (see `migration`).

        Returns a final delta when the sample has nothing left to generate; raises
        Unavailable when it cannot move (n > 1, too many migrations, no worker left).
        """
        self.placement.leave(running, abort=True)  # the worker may still be alive, only unreachable
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
            self.placement.move(
                spec.request_id, running, len(resumed.prompt_token_ids), lost, len(text.token_ids),
                max_migrations=self.options.max_migrations,
            )
            try:
                await start_colocated(
                    self.pool, moved_spec, resumed.prompt_token_ids, running, gateway_id=self.options.gateway_id
                )
                return None
            except Unavailable as error:
                lost = WorkerLost(str(error))
                self.placement.leave(running, abort=True)
