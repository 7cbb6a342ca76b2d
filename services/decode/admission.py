"""Admission and KV transfers on the decode worker: from Admit to the engine, and every way
an admitted request's blocks are freed before it gets there.

    admit(spec)          reserve blocks for the prompt (engine.handoff.reserve; waiting in
                         `admission_queue` while the pool is full), register the transfer
                         with the KV receiver, arm the deadline -> TransferHandle
    start_request(spec)  wait for the transfer (bounded by the deadline), then
                         engine.handoff.receive(prompt, first tokens); or, with
                         prefill_locally, queue the prompt in the engine (colocated)

A transfer that fails, or a deadline that passes before Start, releases the reservation and
ends the request with one ERROR delta on its gateway's stream; the error is remembered
(`MAX_REMEMBERED_FAILURES`) so a late Start raises the real reason. The reservation is this
worker's until `handoff.receive` returns, the engine's from then on (`KVHandoff`).
"""

from __future__ import annotations

import asyncio
import collections
import copy
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field

from cleave.engine.async_engine import AsyncEngine
from cleave.engine.llm_engine import LLMEngine
from cleave.engine.step_trace import TraceOrigin
from cleave.errors import CleaveError, DeadlineExceeded, InvalidArgument, NotFound, ResourceExhausted
from cleave.generation.outputs import FinishReason
from cleave.generation.sampling_params import SamplingParams
from cleave.rpc.convert import apply_reasoning
from cleave.rpc.drain import DrainGate
from cleave.rpc.types import ErrorInfo, RequestDelta, TopLogprobs, TransferHandle
from cleave.tracing import span
from cleave.transfer import KVReceiver, PendingTransfer
from cleave.transfer.rank_receivers import RankedTransfer, RankReceivers
from services.decode.admission_queue import AdmissionQueue
from services.decode.backend import AdmitSpec, StartSpec
from services.decode.peers import PeerLinks

MAX_REMEMBERED_FAILURES = 4096  # failed admissions kept so a late Start gets the real error


@dataclass
class HeldRequest:
    """A request this worker holds: admitted (KV on its way) or started (in the engine)."""

    request_id: str
    gateway_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    transfer: PendingTransfer | RankedTransfer | None = None
    timer: asyncio.TimerHandle | None = None
    started: bool = False  # handed to the engine: from now on the engine frees its blocks
    leading_logprobs: tuple[TopLogprobs, ...] = ()
    # Samples whose first token the client already has (Start.first_tokens_delivered): their
    # first delta leaves it out.
    delivered_first: set[int] = field(default_factory=set)
    aborted_samples: set[int] = field(default_factory=set)  # aborted before Start: end them there
    # Start's trace context and time, until the first published delta (`decode.first_step`)
    trace_start: TraceOrigin | None = None


class Admissions:
    """Admit and Start on the decode worker (see the module docstring).

    Owns the table of held requests, their reservations, transfer deadlines and remembered
    failures, and the queue of Admits waiting for blocks. `EngineDecodeBackend` delegates to
    it; `StepDelivery` reads the table (`held`) and removes what the engine finished (`finish`).

    Args:
        worker_id: this worker's id, in transfer ids and handles.
        transfer_timeout_s: an admitted request must be started within this time.
        gate: the worker's drain gate; Admit and a local Start are refused once it closes.
        peers: the transports negotiated with prefill workers.
        queue: Admits waiting for free KV blocks.
        require_engine: the loaded, running engine and KV receiver (a tensor-parallel worker's:
            every rank's), or the error saying why not.
        async_engine: the engine's async front, None before it loaded (aborts and releases
            go to it even while it stops).
        end_request: deliver a request's last delta (ABORT, or ERROR with the reason) to its
            gateway's stream.
    """

    def __init__(
        self,
        *,
        worker_id: str,
        transfer_timeout_s: float,
        gate: DrainGate,
        peers: PeerLinks,
        queue: AdmissionQueue,
        require_engine: Callable[[], tuple[LLMEngine, AsyncEngine, KVReceiver | RankReceivers]],
        async_engine: Callable[[], AsyncEngine | None],
        end_request: Callable[[str, RequestDelta], None],
    ) -> None:
        self.worker_id = worker_id
        self.control_address = ""  # put in every TransferHandle; set once the server is bound
        self.transfer_timeout_s = transfer_timeout_s
        self.gate = gate
        self.peers = peers
        self.queue = queue
        self._require_engine = require_engine
        self._async_engine = async_engine
        self._end_request = end_request
        self._requests: dict[str, HeldRequest] = {}
        self._failures: collections.OrderedDict[str, CleaveError] = collections.OrderedDict()
        self._transfer_ids = itertools.count()
        self._tasks: set[asyncio.Task] = set()

    # ---- the table ------------------------------------------------------------------------

    def held(self, request_id: str) -> HeldRequest | None:
        """The request if this worker holds it (admitted or started)."""
        return self._requests.get(request_id)

    def finish(self, request_id: str) -> None:
        """Forget a request the engine finished (it freed the blocks)."""
        del self._requests[request_id]

    @property
    def is_empty(self) -> bool:
        return not self._requests

    @property
    def num_held(self) -> int:
        return len(self._requests)

    @property
    def num_started(self) -> int:
        return sum(1 for request in self._requests.values() if request.started)

    def wake(self) -> None:
        """Blocks may have been freed: let the head of the queue try again."""
        self.queue.wake()

    # ---- admission ------------------------------------------------------------------------

    def _check_new(self, request_id: str) -> None:
        if request_id in self._requests:
            raise InvalidArgument(f"{request_id!r} is already on this worker; use a unique id", field="request_id")
        self._failures.pop(request_id, None)

    async def admit(self, spec: AdmitSpec) -> TransferHandle:
        engine, async_engine, receiver = self._require_engine()
        self.gate.check()
        request_id, prompt = spec.request_id, list(spec.prompt_token_ids)
        self._check_new(request_id)
        await async_engine.prepare(request_id, prompt, spec.sampling)  # validation only: no engine state
        transport, nccl = await self.peers.transport_for(spec.prefill_worker_id, self.transfer_timeout_s)
        needed, usable = engine.handoff.num_blocks_for(len(prompt)), engine.handoff.snapshot().num_usable_blocks
        if needed > usable:
            raise ResourceExhausted(f"the {len(prompt)}-token prompt needs {needed} KV blocks; this decode worker "
                                    f"has {usable} in all", field="prompt_token_ids")
        block_ids = await self.queue.reserve(
            lambda: self._reserve(async_engine, request_id, len(prompt), spec.sampling.priority),
            spec.sampling.priority)
        if self.gate.is_draining:  # the drain began while this admission waited
            self._release_reservation(request_id)
            raise self.gate.error()
        request = HeldRequest(request_id, spec.gateway_id, prompt, spec.sampling)
        self._requests[request_id] = request
        try:
            request.transfer = receiver.expect(
                f"{self.worker_id}/{request_id}/{next(self._transfer_ids)}",
                block_ids,
                num_cached_blocks=engine.handoff.num_unseen_pages(len(prompt)),  # never read: never sent
                timeout_s=self.transfer_timeout_s,
                transport=transport,
                nccl=nccl,
                worker_id=self.worker_id,
                control_address=self.control_address,
            )
            handle = await request.transfer.registered()  # a tensor-parallel worker's ranks all expect it
            if self._requests.get(request_id) is not request:  # aborted meanwhile: already released
                raise self._failures.pop(request_id, None) or NotFound(f"request {request_id!r} was aborted")
        except BaseException:
            if self._requests.get(request_id) is request:
                del self._requests[request_id]
                if request.transfer is not None:
                    request.transfer.cancel(f"request {request_id!r} was not admitted")
                self._release_reservation(request_id)
            raise
        request.timer = asyncio.get_running_loop().call_later(self.transfer_timeout_s, self._expire, request_id)
        self._spawn(self._watch_transfer(request))
        return handle

    async def _reserve(self, async_engine: AsyncEngine, request_id: str, num_tokens: int, priority: int) -> list[int]:
        """`handoff.reserve` on the step thread. The step thread reserves whether or not the
        Admit still waits for the blocks, so an Admit cancelled meanwhile (its prefill worker
        gave up or died) releases them once they come back: nothing else knows of them (no
        HeldRequest, no deadline), so they would stay reserved for good. A later admission of
        the id reserves on the same thread after this one: before the release, it finds the id
        holding blocks and is refused; so the release never frees its blocks."""
        reserving = asyncio.ensure_future(async_engine.call(lambda e: e.handoff.reserve(request_id, num_tokens,
                                                                                         priority)))
        try:
            return await asyncio.shield(reserving)
        except asyncio.CancelledError:
            reserving.add_done_callback(
                lambda done: done.cancelled() or done.exception() is not None or self._release_reservation(request_id))
            raise

    async def _watch_transfer(self, request: HeldRequest) -> None:
        assert request.transfer is not None
        try:
            with span("decode.kv_receive"):
                await request.transfer.wait()
        except CleaveError as error:
            if self._requests.get(request.request_id) is request and not request.started:
                self._fail(request.request_id, error)

    def _expire(self, request_id: str) -> None:
        request = self._requests.get(request_id)
        if request is not None and not request.started:
            self._fail(request_id, DeadlineExceeded(
                f"request {request_id!r} was not started within {self.transfer_timeout_s:g} s of Admit "
                "(its KV did not arrive or Start never came); its KV blocks were freed"))

    def _drop_admission(self, request_id: str) -> HeldRequest | None:
        """Forget an admitted (not started) request and free its reservation."""
        request = self._requests.get(request_id)
        if request is None or request.started:
            return None
        del self._requests[request_id]
        if request.timer is not None:
            request.timer.cancel()
        if request.transfer is not None and not request.transfer.done:
            request.transfer.cancel(f"request {request_id!r} was aborted or failed on the decode worker")
        self._release_reservation(request_id)
        return request

    def _fail(self, request_id: str, error: CleaveError) -> None:
        request = self._drop_admission(request_id)
        if request is None:
            return
        self._failures[request_id] = error
        while len(self._failures) > MAX_REMEMBERED_FAILURES:
            self._failures.popitem(last=False)
        info = ErrorInfo(code=error.status_code, message=str(error), field=error.field or "")
        self._end_request(request.gateway_id, RequestDelta(request_id, 0, (), FinishReason.ERROR, error=info))

    def _release_reservation(self, request_id: str) -> None:
        async_engine = self._async_engine()
        if async_engine is not None and async_engine.is_running:
            self._spawn(self._release(async_engine, request_id))

    async def _release(self, async_engine: AsyncEngine, request_id: str) -> None:
        try:
            await async_engine.call(lambda e: e.handoff.release(request_id))
        finally:
            self.queue.wake()  # a waiting admission may fit now

    def _spawn(self, awaitable) -> None:
        task = asyncio.ensure_future(awaitable)
        self._tasks.add(task)
        task.add_done_callback(_settled(self._tasks))

    # ---- abort ----------------------------------------------------------------------------

    async def abort(self, request_id: str, sample_index: int | None = None) -> bool:
        """Abort a request, or only its sample `sample_index`; False if unknown or finished."""
        if sample_index is None:
            return self.abort_now(request_id)
        request = self._requests.get(request_id)
        if request is None or not 0 <= sample_index < request.params.n:
            return False
        if not request.started:  # samples exist once started: end this one as it starts
            if request.params.n == 1:
                return self.abort_now(request_id)
            request.aborted_samples.add(sample_index)
            return True
        async_engine = self._async_engine()
        assert async_engine is not None
        # Through the command queue, between steps: the engine frees the sample's blocks and
        # reports its ABORT with the next step; the request's other samples go on.
        return await async_engine.call(lambda e: e.abort_sample(request_id, sample_index))

    def abort_now(self, request_id: str) -> bool:
        """Abort a whole request: the engine frees a started one's blocks and reports its
        ABORT with a step; an admitted one's reservation is released here and its ABORT
        delta goes out at once. False if unknown."""
        request = self._requests.get(request_id)
        if request is None:
            return False
        if request.started:
            async_engine = self._async_engine()
            assert async_engine is not None
            async_engine.abort(request_id)  # the engine frees the blocks; ABORT comes with a step
            return True
        self._drop_admission(request_id)
        self._end_request(request.gateway_id, RequestDelta(request_id, 0, (), FinishReason.ABORT))
        return True

    def abort_gateway(self, gateway_id: str) -> None:
        """The gateway's stream ended: nobody receives these requests' tokens any more."""
        for request_id, request in list(self._requests.items()):
            if request.gateway_id == gateway_id:
                self.abort_now(request_id)

    def abort_all(self) -> None:
        for request_id in list(self._requests):
            self.abort_now(request_id)

    # ---- start ----------------------------------------------------------------------------

    async def start_request(self, spec: StartSpec) -> int:
        if spec.prefill_locally:
            return await self._start_local(spec)
        _, async_engine, _ = self._require_engine()
        request_id = spec.request_id
        request = self._requests.get(request_id)
        if request is None:
            error = self._failures.pop(request_id, None)
            if error is not None:
                raise error
            raise NotFound(f"request {request_id!r} is not admitted on this worker; call Admit first", field="request_id")
        if request.started or request.transfer is None:
            raise InvalidArgument(f"request {request_id!r} was already started", field="request_id")
        if spec.gateway_id and spec.gateway_id != request.gateway_id:
            raise InvalidArgument(f"differs from the gateway given to Admit ({request.gateway_id!r})", field="gateway_id")
        if len(spec.first_token_ids) != request.params.n:
            raise InvalidArgument(f"needs {request.params.n} token(s), one per sample", field="first_token_ids")
        params = copy.copy(spec.sampling or request.params)
        if spec.reasoning is not None:
            apply_reasoning(params, spec.reasoning)
        try:
            await request.transfer.wait()  # fails with DeadlineExceeded at the deadline
        except CleaveError as error:
            self._fail(request_id, error)
            self._failures.pop(request_id, None)
            raise
        except asyncio.CancelledError:
            self.abort_now(request_id)
            raise
        if self._requests.get(request_id) is not request:  # aborted or failed meanwhile
            raise self._failures.pop(request_id, None) or NotFound(f"request {request_id!r} was aborted")
        request.started = True
        request.trace_start = TraceOrigin.capture()
        if request.timer is not None:
            request.timer.cancel()
        if spec.first_tokens_delivered:
            request.delivered_first = set(range(request.params.n))
        request.leading_logprobs = spec.first_token_logprobs  # aligns the first delta's logprobs
        prompt, first_tokens = request.prompt_token_ids, list(spec.first_token_ids)
        aborted = sorted(request.aborted_samples)

        def add(e: LLMEngine) -> None:
            e.handoff.receive(request_id, prompt, first_tokens, params)
            for index in aborted:
                e.abort_sample(request_id, index)

        try:
            await async_engine.call(add)
        except CleaveError:
            self._requests.pop(request_id, None)
            self._release_reservation(request_id)
            raise
        return 0

    async def _start_local(self, spec: StartSpec) -> int:
        _, async_engine, _ = self._require_engine()
        request_id, prompt = spec.request_id, list(spec.prompt_token_ids)
        assert spec.sampling is not None  # the servicer requires it with prefill_locally
        params = copy.copy(spec.sampling)
        if spec.reasoning is not None:
            apply_reasoning(params, spec.reasoning)
        state = await async_engine.prepare(request_id, prompt, params)  # a grammar compiles off the loop
        self.gate.check()  # after the await: nothing between these checks and the registration yields
        self._check_new(request_id)
        origin = TraceOrigin.capture()
        self._requests[request_id] = HeldRequest(
            request_id, spec.gateway_id, prompt, params, started=True, trace_start=origin)

        def enqueue(e: LLMEngine) -> int:
            cached = e.handoff.cached_prefix(prompt, params.cache_salt)
            e.enqueue(state)
            if origin is not None:  # the same engine spans as a prefill worker's
                async_engine.step_trace.watch(state, origin)
            return cached

        try:
            return await async_engine.call(enqueue)
        except asyncio.CancelledError:
            # the engine queues the prompt all the same; the abort follows it there
            self.abort_now(request_id)
            raise
        except BaseException:
            self._requests.pop(request_id, None)
            raise


def _settled(tasks: set[asyncio.Task]):
    def done(task: asyncio.Task) -> None:
        tasks.discard(task)
        if not task.cancelled():
            task.exception()  # failures of background releases are already reported elsewhere

    return done

