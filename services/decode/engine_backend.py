"""The engine-backed decode worker: KV admission, continuous batching, per-gateway streams.

Life of a disaggregated request on this worker:

    admit(spec)    reserve blocks for the prompt (engine.reserve_prefilled), register the
                   transfer with the KV receiver, arm the deadline -> TransferHandle
    (prefill worker writes the KV into the reserved blocks over the handle's transport)
    start(spec)    wait for the transfer (bounded by the deadline), then
                   engine.add_prefilled_request(prompt, first tokens) -> decoding (n
                   samples from one reservation: they share the prompt's blocks)
    engine steps   every step's outputs become RequestDeltas, one StepOutput per gateway

Colocated mode skips admit: start(prefill_locally) queues the prompt in the same engine.
The engine makes no text (`detokenize` off): the step stream carries token ids, and the
gateway detokenizes, matches stop strings and aborts a request whose stop string matched.

Every way out frees the blocks: a finished or aborted request is freed by the engine; an
admitted request that is aborted, whose transfer fails or whose deadline passes before Start
has its reservation released here and ends with one delta (ABORT, or ERROR with the reason)
on its gateway's stream. Every request ends exactly once on the stream.
"""

from __future__ import annotations

import asyncio
import collections
import copy
import itertools
import socket
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace

from cleave.engine.async_engine import AsyncEngine
from cleave.engine.config import EngineConfig
from cleave.engine.llm_engine import LLMEngine
from cleave.engine.outputs import FinishReason, RequestOutput
from cleave.engine.sampling_params import SamplingParams
from cleave.errors import CleaveError, DeadlineExceeded, FailedPrecondition, InvalidArgument, NotFound, Unavailable
from cleave.kv.prefix_hash import block_hashes
from cleave.rpc.convert import apply_reasoning
from cleave.rpc.types import (
    ErrorInfo,
    KVLayout,
    RequestDelta,
    StepOutput,
    TopLogprobs,
    TransferHandle,
    TransportKind,
    WorkerLoad,
)
from cleave.transfer import KVReceiver, PendingTransfer, choose_transport, local_endpoint, peer_endpoint
from cleave.transfer.layout import require_same_layout
from cleave.worker import DeltaBuilder, kv_layout_of, load_engine
from services.decode.backend import AdmitSpec, HandshakeResult, HandshakeSpec, StartSpec
from services.decode.gateway_streams import GatewayStreams

MAX_REMEMBERED_FAILURES = 4096  # failed admissions kept so a late Start gets the real error
RATE_WINDOW_S = 5.0


@dataclass
class _Request:
    """A request this worker holds: admitted (KV on its way) or started (in the engine)."""

    request_id: str
    gateway_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    transfer: PendingTransfer | None = None
    timer: asyncio.TimerHandle | None = None
    started: bool = False  # handed to the engine: from now on the engine frees its blocks
    leading_logprobs: tuple[TopLogprobs, ...] = ()


@dataclass
class _Peer:
    """A prefill worker that handshook: the transport its transfers use."""

    transport: TransportKind
    nccl: asyncio.Task | None = None  # joins the two-rank communicator


@dataclass
class _TokenRate:
    """Generated tokens per second over the last few seconds."""

    events: collections.deque = field(default_factory=collections.deque)

    def add(self, num_tokens: int) -> None:
        now = time.monotonic()
        self.events.append((now, num_tokens))
        while self.events and now - self.events[0][0] > RATE_WINDOW_S:
            self.events.popleft()

    def per_second(self) -> float:
        if not self.events:
            return 0.0
        span = max(time.monotonic() - self.events[0][0], 1e-3)
        return sum(count for _, count in self.events) / max(span, 1.0)


class EngineDecodeBackend:
    """A DecodeBackend over an AsyncEngine and a KVReceiver.

    Args:
        engine_config: the model and engine to load at `start()`.
        worker_id: stable id, echoed in handles and load reports.
        model_id: model identity of the KV layout peers must match.
        transfer_listen: host:port of the bulk KV endpoint (port 0: any free port).
        advertise_host: host senders should connect to (default: the listen host, or the
            hostname when listening on all interfaces).
        control_address: this worker's gRPC host:port, put in every TransferHandle so a
            prefill worker can call Handshake here; usually set once the server is bound
            (`set_control_address`). Empty: prefill workers keep to the handles' TCP.
        transfer_timeout_s: an admitted request's KV must arrive and Start must come within
            this time, or its blocks are freed and it fails with DEADLINE_EXCEEDED.
    """

    def __init__(
        self,
        engine_config: EngineConfig,
        *,
        worker_id: str,
        model_id: str,
        transfer_listen: str = "127.0.0.1:0",
        advertise_host: str | None = None,
        transfer_timeout_s: float = 30.0,
        load_interval_s: float = 1.0,
        control_address: str = "",
    ) -> None:
        self.engine_config = replace(engine_config, detokenize=False)  # the gateway makes the text
        self.worker_id = worker_id
        self.model_id = model_id
        self.transfer_timeout_s = transfer_timeout_s
        self._transfer_listen = transfer_listen
        self._advertise_host = advertise_host
        self.control_address = ""
        if control_address:
            self.set_control_address(control_address)
        self.engine: LLMEngine | None = None
        self.async_engine: AsyncEngine | None = None
        self.receiver: KVReceiver | None = None
        self.layout: KVLayout | None = None
        self.streams = GatewayStreams(self.load, self._abort_gateway, load_interval_s)
        self._requests: dict[str, _Request] = {}
        self._failures: collections.OrderedDict[str, CleaveError] = collections.OrderedDict()
        self._peers: dict[str, _Peer] = {}
        self._builder = DeltaBuilder()
        self._rate = _TokenRate()
        self._transfer_ids = itertools.count()
        self._step = 0  # written by the engine thread only
        self._loop: asyncio.AbstractEventLoop | None = None
        self._tasks: set[asyncio.Task] = set()

    # ---- lifecycle ------------------------------------------------------------------------

    def set_control_address(self, address: str) -> None:
        """The gRPC address this worker listens on (a wildcard host becomes the advertised
        host, or the hostname), for TransferHandle.control_address."""
        host, _, port = address.rpartition(":")
        if host in ("0.0.0.0", "::", "[::]", ""):
            host = self._advertise_host or socket.gethostname()
        self.control_address = f"{host}:{port}"

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self.engine = await load_engine(self.engine_config)
        self.layout = kv_layout_of(self.engine, self.model_id)
        host, _, port = self._transfer_listen.rpartition(":")
        self.receiver = KVReceiver(
            self.engine.kv_cache, host=host, port=int(port), advertise_host=self._advertise_host, layout=self.layout
        )
        await self.receiver.start()
        self.async_engine = AsyncEngine(self.engine, on_step=self._on_step)

    async def shutdown(self) -> None:
        self.streams.close()
        for request_id in list(self._requests):
            self._abort_now(request_id)
        if self.receiver is not None:
            await self.receiver.close()
        if self.async_engine is not None:
            await self.async_engine.shutdown()
        for peer in self._peers.values():
            if peer.nccl is not None and peer.nccl.done() and not peer.nccl.exception():
                peer.nccl.result().close()

    def _require_engine(self) -> tuple[LLMEngine, AsyncEngine, KVReceiver]:
        if self.engine is None or self.async_engine is None or self.receiver is None:
            raise FailedPrecondition("the decode worker is still loading its model; retry shortly")
        if not self.async_engine.is_running:
            raise Unavailable("the decode worker's engine stopped")
        return self.engine, self.async_engine, self.receiver

    # ---- admission ------------------------------------------------------------------------

    def _check_new(self, request_id: str) -> None:
        if request_id in self._requests:
            raise InvalidArgument(f"{request_id!r} is already on this worker; use a unique id", field="request_id")
        self._failures.pop(request_id, None)

    async def admit(self, spec: AdmitSpec) -> TransferHandle:
        engine, async_engine, receiver = self._require_engine()
        request_id, prompt = spec.request_id, list(spec.prompt_token_ids)
        self._check_new(request_id)
        engine.prepare_request(request_id, prompt, spec.sampling)  # validation only: no engine state
        transport, nccl = await self._transport_for(spec.prefill_worker_id)
        block_ids = await async_engine.call(lambda e: e.reserve_prefilled(request_id, len(prompt)))
        request = _Request(request_id, spec.gateway_id, prompt, spec.sampling)
        self._requests[request_id] = request
        try:
            request.transfer = receiver.expect(
                f"{self.worker_id}/{request_id}/{next(self._transfer_ids)}",
                block_ids,
                timeout_s=self.transfer_timeout_s,
                transport=transport,
                nccl=nccl,
                worker_id=self.worker_id,
                control_address=self.control_address,
            )
        except BaseException:
            del self._requests[request_id]
            self._release_reservation(request_id)
            raise
        assert self._loop is not None
        request.timer = self._loop.call_later(self.transfer_timeout_s, self._expire, request_id)
        self._spawn(self._watch_transfer(request))
        return request.transfer.handle

    async def _watch_transfer(self, request: _Request) -> None:
        assert request.transfer is not None
        try:
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

    def _drop_admission(self, request_id: str) -> _Request | None:
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
        delta = RequestDelta(request_id, 0, (), FinishReason.ERROR, error=info)
        self.streams.publish(request.gateway_id, [delta], self._step)

    def _release_reservation(self, request_id: str) -> None:
        if self.async_engine is not None and self.async_engine.is_running:
            self._spawn(self.async_engine.call(lambda e: e.kv.release(f"{request_id}/0")))

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
            self._abort_now(request_id)
            raise
        if self._requests.get(request_id) is not request:  # aborted or failed meanwhile
            raise self._failures.pop(request_id, None) or NotFound(f"request {request_id!r} was aborted")
        request.started = True
        if request.timer is not None:
            request.timer.cancel()
        request.leading_logprobs = spec.first_token_logprobs
        prompt, first_tokens = request.prompt_token_ids, list(spec.first_token_ids)
        try:
            await async_engine.call(lambda e: e.add_prefilled_request(request_id, prompt, first_tokens, params))
        except CleaveError:
            self._requests.pop(request_id, None)
            self._release_reservation(request_id)
            raise
        return 0

    async def _start_local(self, spec: StartSpec) -> int:
        engine, async_engine, _ = self._require_engine()
        request_id, prompt = spec.request_id, list(spec.prompt_token_ids)
        self._check_new(request_id)
        assert spec.sampling is not None  # the servicer requires it with prefill_locally
        params = copy.copy(spec.sampling)
        if spec.reasoning is not None:
            apply_reasoning(params, spec.reasoning)
        state = engine.prepare_request(request_id, prompt, params)
        self._requests[request_id] = _Request(request_id, spec.gateway_id, prompt, params, started=True)

        def enqueue(e: LLMEngine) -> int:
            cached = _num_cached_prompt_tokens(e, prompt)
            e.enqueue(state)
            return cached

        try:
            return await async_engine.call(enqueue)
        except BaseException:
            self._requests.pop(request_id, None)
            raise

    # ---- streams --------------------------------------------------------------------------

    def attach(self, gateway_id: str) -> AsyncIterator[StepOutput]:
        self._require_engine()
        return self.streams.attach(gateway_id)

    def _on_step(self, outputs: list[RequestOutput]) -> None:
        """Engine thread: hand the whole step to the event loop in one callback."""
        self._step += 1
        if self._loop is not None:
            try:
                self._loop.call_soon_threadsafe(self._publish, self._step, outputs)
            except RuntimeError:  # the loop closed during shutdown
                pass

    def _publish(self, step: int, outputs: list[RequestOutput]) -> None:
        by_gateway: dict[str, list[RequestDelta]] = {}
        num_tokens = 0
        for output in outputs:
            request = self._requests.get(output.request_id)
            if request is None:
                continue
            deltas = self._builder.build(output, request.leading_logprobs)
            request.leading_logprobs = ()
            if output.finished:
                del self._requests[output.request_id]
            num_tokens += sum(len(delta.token_ids) for delta in deltas)
            by_gateway.setdefault(request.gateway_id, []).extend(deltas)
        self._rate.add(num_tokens)
        for gateway_id, deltas in by_gateway.items():
            self.streams.publish(gateway_id, deltas, step)

    # ---- abort ----------------------------------------------------------------------------

    async def abort(self, request_id: str, sample_index: int | None = None) -> bool:
        if sample_index is None:
            return self._abort_now(request_id)
        request = self._requests.get(request_id)
        if request is None or not 0 <= sample_index < request.params.n:
            return False
        if not request.started:  # samples exist once started; before, only n = 1 has its one
            return request.params.n == 1 and self._abort_now(request_id)
        assert self.async_engine is not None
        # Through the command queue, between steps: the engine frees the sample's blocks and
        # reports its ABORT with the next step; the request's other samples go on.
        return await self.async_engine.call(lambda e: e.abort_sample(request_id, sample_index))

    def _abort_now(self, request_id: str) -> bool:
        request = self._requests.get(request_id)
        if request is None:
            return False
        if request.started:
            assert self.async_engine is not None
            self.async_engine.abort(request_id)  # the engine frees the blocks; ABORT comes with a step
            return True
        self._drop_admission(request_id)
        self._builder.forget(request_id)
        delta = RequestDelta(request_id, 0, (), FinishReason.ABORT)
        self.streams.publish(request.gateway_id, [delta], self._step)
        return True

    def _abort_gateway(self, gateway_id: str) -> None:
        """The gateway's stream ended: nobody receives these requests' tokens any more."""
        for request_id, request in list(self._requests.items()):
            if request.gateway_id == gateway_id:
                self._abort_now(request_id)

    # ---- load and handshake ---------------------------------------------------------------

    def load(self) -> WorkerLoad:
        if self.engine is None:
            return WorkerLoad(worker_id=self.worker_id)
        running = sum(1 for request in self._requests.values() if request.started)
        kv = self.engine.kv
        return WorkerLoad(
            worker_id=self.worker_id,
            num_running=running,
            num_waiting=len(self._requests) - running,
            num_free_blocks=kv.num_free_blocks,
            num_total_blocks=kv.num_usable_blocks,
            max_num_running=self.engine.config.scheduler.max_num_seqs,
            tokens_per_second=self._rate.per_second(),
        )

    async def handshake(self, spec: HandshakeSpec) -> HandshakeResult:
        engine, _, receiver = self._require_engine()
        assert self.layout is not None
        if spec.layout is not None:
            require_same_layout(self.layout, spec.layout, "layout")
        device = engine.kv_cache.device
        local = local_endpoint(device, nccl_available=bool(spec.nccl_unique_id))
        transport = choose_transport(peer_endpoint(spec.host, spec.gpu_uuids, spec.supported_transports, local), local)
        nccl_task = None
        if transport is TransportKind.NCCL:
            from cleave.transfer.nccl import NcclCommunicator

            # Returns once the prefill worker joins as rank 0 (after this reply).
            nccl_task = asyncio.ensure_future(NcclCommunicator.create(spec.nccl_unique_id, rank=1, device=device))
        self._peers[spec.peer_id] = _Peer(transport, nccl_task)
        return HandshakeResult(
            transport=transport, worker_id=self.worker_id, layout=self.layout, rank=1, world_size=2,
            tcp_address=receiver.address,
        )

    async def _transport_for(self, prefill_worker_id: str):  # -> (TransportKind, NcclCommunicator | None)
        peer = self._peers.get(prefill_worker_id)
        if peer is None:
            return TransportKind.TCP, None
        if peer.nccl is None:
            return peer.transport, None
        try:
            return peer.transport, await asyncio.wait_for(asyncio.shield(peer.nccl), self.transfer_timeout_s)
        except (asyncio.TimeoutError, CleaveError, OSError) as error:
            raise Unavailable(f"NCCL link with {prefill_worker_id!r} is not up: {error}; handshake again") from None

    def _spawn(self, awaitable) -> None:
        task = asyncio.ensure_future(awaitable)
        self._tasks.add(task)
        task.add_done_callback(_settled(self._tasks))


def _settled(tasks: set[asyncio.Task]):
    def done(task: asyncio.Task) -> None:
        tasks.discard(task)
        if not task.cancelled():
            task.exception()  # failures of background releases are already reported elsewhere

    return done


def _num_cached_prompt_tokens(engine: LLMEngine, prompt: list[int]) -> int:
    """Leading prompt tokens whose full blocks are in the engine's prefix cache now (what its
    scheduler will reuse unless they are evicted first; the last token is always computed)."""
    if not engine.kv.enable_prefix_caching:
        return 0
    block_size = engine.kv.block_size
    usable = (len(prompt) - 1) // block_size
    hits = 0
    for block_hash in block_hashes(prompt[: usable * block_size], block_size, engine.kv.namespace):
        if engine.kv.pool.lookup(block_hash) is None:
            break
        hits += 1
    return hits * block_size
