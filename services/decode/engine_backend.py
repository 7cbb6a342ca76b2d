"""The engine-backed decode worker: KV admission, continuous batching, per-gateway streams.

Life of a disaggregated request on this worker:

    admit(spec)    reserve blocks for the prompt (engine.handoff.reserve), register the
                   transfer with the KV receiver, arm the deadline -> TransferHandle
    (prefill worker writes the KV into the reserved blocks over the handle's transport)
    start(spec)    wait for the transfer (bounded by the deadline), then
                   engine.handoff.receive(prompt, first tokens) -> decoding (n
                   samples from one reservation: they share the prompt's blocks)
    engine steps   every step's outputs become RequestDeltas, one StepOutput per gateway

Colocated mode skips admit: start(prefill_locally) queues the prompt in the same engine.
The engine makes no text (`detokenize` off): the step stream carries token ids, and the
gateway detokenizes, matches stop strings and aborts a request whose stop string matched.

Every way out frees the blocks: a finished or aborted request is freed by the engine; an
admitted request that is aborted, whose transfer fails or whose deadline passes before Start
has its reservation released here and ends with one delta (ABORT, or ERROR with the reason)
on its gateway's stream. Every request ends exactly once on the stream.

Roles: admission and transfers (`admission`), handshakes and transports (`peers`), engine
steps to gateway streams (`step_delivery`); this class loads the engine and ties them together.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import socket
from collections.abc import AsyncIterator
from dataclasses import replace

from cleave.engine.async_engine import AsyncEngine
from cleave.engine.config import EngineConfig
from cleave.engine.llm_engine import LLMEngine
from cleave.errors import CleaveError, FailedPrecondition, Unavailable
from cleave.generation.outputs import FinishReason
from cleave.rpc.drain import DrainGate, wait_until
from cleave.rpc.types import KVLayout, RequestDelta, StepOutput, WorkerLoad
from cleave.transfer import KVReceiver
from cleave.worker import DeltaBuilder, kv_layout_of, load_engine
from services.decode.admission import AdmissionMixin, HeldRequest
from services.decode.admission_queue import DEFAULT_MAX_QUEUED_ADMISSIONS, AdmissionQueue
from services.decode.backend import HandshakeResult, HandshakeSpec
from services.decode.gateway_streams import GatewayStreams
from services.decode.peers import PeerLinks
from services.decode.step_delivery import StepDeliveryMixin, TokenRate


class EngineDecodeBackend(AdmissionMixin, StepDeliveryMixin):
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
        internal_token: bulk KV connections must open with this shared secret (`cleave.rpc.auth`);
            None: any connection is read.
        max_queued_admissions: Admits that may wait for free KV blocks at once
            (`admission_queue`); one more is RESOURCE_EXHAUSTED.
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
        internal_token: str | None = None,
        max_queued_admissions: int = DEFAULT_MAX_QUEUED_ADMISSIONS,
    ) -> None:
        self.engine_config = replace(engine_config, detokenize=False)  # the gateway makes the text
        self._internal_token = internal_token  # prefill workers' bulk KV connections must open with it
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
        self.peers = PeerLinks(worker_id)
        self._requests: dict[str, HeldRequest] = {}
        self._failures: collections.OrderedDict[str, CleaveError] = collections.OrderedDict()
        self._builder = DeltaBuilder()
        self._rate = TokenRate()
        self._transfer_ids = itertools.count()
        self._step = 0  # written by the engine thread only
        self._loop: asyncio.AbstractEventLoop | None = None
        self._tasks: set[asyncio.Task] = set()
        self.gate = DrainGate(f"decode worker {worker_id}")
        self.admissions = AdmissionQueue(max_queued_admissions)

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
            self.engine.kv_cache, host=host, port=int(port), advertise_host=self._advertise_host, layout=self.layout,
            internal_token=self._internal_token,
        )
        await self.receiver.start()
        self.async_engine = AsyncEngine(self.engine, on_step=self._on_step)

    async def drain(self) -> None:
        """Refuse new requests (Admit, a local Start), let the held ones finish and their
        last deltas go out, then end the gateways' streams cleanly (`cleave.rpc.Drainable`)."""
        self.gate.close()
        self.admissions.fail_all(self.gate.error())  # waiting for blocks: not admitted yet
        await wait_until(lambda: not self._requests and self.streams.is_flushed())
        self.streams.close()

    async def shutdown(self) -> None:
        self.streams.close()
        for request_id in list(self._requests):
            self._abort_now(request_id)
        if self.receiver is not None:
            await self.receiver.close()
        if self.async_engine is not None:
            await self.async_engine.shutdown()
        self.peers.close()

    def _require_engine(self) -> tuple[LLMEngine, AsyncEngine, KVReceiver]:
        if self.engine is None or self.async_engine is None or self.receiver is None:
            raise FailedPrecondition("the decode worker is still loading its model; retry shortly")
        if not self.async_engine.is_running:
            raise Unavailable("the decode worker's engine stopped")
        return self.engine, self.async_engine, self.receiver

    # ---- streams --------------------------------------------------------------------------

    def attach(self, gateway_id: str) -> AsyncIterator[StepOutput]:
        self._require_engine()
        return self.streams.attach(gateway_id)

    # ---- abort ----------------------------------------------------------------------------

    async def abort(self, request_id: str, sample_index: int | None = None) -> bool:
        if sample_index is None:
            return self._abort_now(request_id)
        request = self._requests.get(request_id)
        if request is None or not 0 <= sample_index < request.params.n:
            return False
        if not request.started:  # samples exist once started: end this one as it starts
            if request.params.n == 1:
                return self._abort_now(request_id)
            request.aborted_samples.add(sample_index)
            return True
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
        kv = self.engine.handoff.snapshot()
        return WorkerLoad(
            worker_id=self.worker_id,
            num_running=running,
            num_waiting=len(self._requests) - running + self.admissions.num_waiting,  # admitted or queued
            num_free_blocks=kv.num_free_blocks,
            num_total_blocks=kv.num_usable_blocks,
            max_num_running=self.engine.config.scheduler.max_num_seqs,
            tokens_per_second=self._rate.per_second(),
        )

    async def handshake(self, spec: HandshakeSpec) -> HandshakeResult:
        engine, _, receiver = self._require_engine()
        assert self.layout is not None
        return await self.peers.handshake(spec, engine.kv_cache.device, receiver, self.layout)
