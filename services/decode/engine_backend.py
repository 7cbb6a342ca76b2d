"""The engine-backed decode worker: KV admission, continuous batching, per-gateway streams.

Life of a disaggregated request on this worker:

    admit(spec)    reserve blocks for the prompt (engine.handoff.reserve), register the
                   transfer with the KV receiver, arm the deadline -> TransferHandle
    (prefill worker writes the KV into the reserved blocks over the handle's transport)
    start(spec)    wait for the transfer (bounded by the deadline), then
                   engine.handoff.receive(prompt, first tokens) -> decoding (n
                   samples from one reservation: they share the prompt's blocks)
    engine steps   every step's outputs become RequestDeltas, one StepOutput per gateway

A tensor-parallel worker (`--tensor-parallel-size N`, `cleave.engine.lockstep`) mirrors the
reservation and the receive on every rank, and each rank takes its slice of the KV heads
over its own bulk endpoint: the handle lists the other ranks' (`rank_handles`, TCP;
`cleave.transfer.rank_receivers`), and the transfer completes when every rank's did.

Colocated mode skips admit: start(prefill_locally) queues the prompt in the same engine.
The engine makes no text (`detokenize` off): the step stream carries token ids, and the
gateway detokenizes, matches stop strings and aborts a request whose stop string matched.

Every way out frees the blocks: a finished or aborted request is freed by the engine; an
admitted request that is aborted, whose transfer fails or whose deadline passes before Start
has its reservation released here and ends with one delta (ABORT, or ERROR with the reason)
on its gateway's stream. Every request ends exactly once on the stream.

Roles, each an object of its own: admission, transfers and the table of held requests
(`admission.Admissions`), handshakes and transports (`peers.PeerLinks`), engine steps to
gateway streams (`step_delivery.StepDelivery`); this class loads the engine, wires them
together and delegates to them.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator
from dataclasses import replace

from cleave.engine.async_engine import AsyncEngine
from cleave.engine.config import EngineConfig
from cleave.engine.llm_engine import LLMEngine
from cleave.engine.lockstep import LockstepEngine
from cleave.errors import FailedPrecondition, Unavailable
from cleave.rpc.drain import DrainGate, wait_until
from cleave.rpc.types import KVLayout, RequestDelta, StepOutput, TransferHandle, WorkerLoad
from cleave.tls import TlsConfig
from cleave.transfer import KVReceiver
from cleave.transfer.rank_receivers import RankReceivers
from cleave.worker import kv_layout_of, load_engine
from cleave.worker.engine_failure import EngineFailure
from services.decode.admission import Admissions
from services.decode.admission_queue import DEFAULT_MAX_QUEUED_ADMISSIONS, AdmissionQueue
from services.decode.backend import AdmitSpec, HandshakeResult, HandshakeSpec, StartSpec
from services.decode.gateway_streams import GatewayStreams
from services.decode.peers import PeerLinks
from services.decode.step_delivery import StepDelivery


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
        internal_token: bulk KV connections must open with this shared secret (`cleave.rpc.auth`);
            None: any connection is read.
        tls: the process's certificate and CA (`cleave.tls`): the bulk KV endpoints serve TLS
            and take only senders presenting a certificate the CA signed; None: plain text.
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
        tls: TlsConfig | None = None,
        max_queued_admissions: int = DEFAULT_MAX_QUEUED_ADMISSIONS,
    ) -> None:
        self.engine_config = replace(engine_config, detokenize=False)  # the gateway makes the text
        self._internal_token = internal_token  # prefill workers' bulk KV connections must open with it
        self._tls = tls
        self.worker_id = worker_id
        self.failure = EngineFailure()  # the engine's error, if it fails: the service then ends
        self.model_id = model_id
        self.transfer_timeout_s = transfer_timeout_s
        self._transfer_listen = transfer_listen
        self._advertise_host = advertise_host
        self.engine: LLMEngine | None = None
        self.async_engine: AsyncEngine | None = None
        self.receiver: KVReceiver | None = None  # rank 0's bulk endpoint (handshakes name it)
        self.transfers: KVReceiver | RankReceivers | None = None  # what admission registers transfers with
        self.layout: KVLayout | None = None
        self.streams = GatewayStreams(self.load, self._abort_gateway, load_interval_s)
        self.peers = PeerLinks(worker_id)
        self.gate = DrainGate(f"decode worker {worker_id}")
        self.admissions = Admissions(
            worker_id=worker_id,
            transfer_timeout_s=transfer_timeout_s,
            gate=self.gate,
            peers=self.peers,
            queue=AdmissionQueue(max_queued_admissions),
            require_engine=self._require_engine,
            async_engine=lambda: self.async_engine,
            end_request=self._end_request,
        )
        self.delivery = StepDelivery(self.admissions, self.streams)
        self.control_address = ""
        if control_address:
            self.set_control_address(control_address)

    # ---- lifecycle ------------------------------------------------------------------------

    def set_control_address(self, address: str) -> None:
        """The gRPC address this worker listens on (a wildcard host becomes the advertised
        host, or the hostname), for TransferHandle.control_address."""
        host, _, port = address.rpartition(":")
        if host in ("0.0.0.0", "::", "[::]", ""):
            host = self._advertise_host or socket.gethostname()
        self.control_address = self.admissions.control_address = f"{host}:{port}"

    async def start(self) -> None:
        self.delivery.start(asyncio.get_running_loop())
        self.engine = await load_engine(self.engine_config)
        self.layout = kv_layout_of(self.engine, self.model_id)
        host, _, port = self._transfer_listen.rpartition(":")
        self.receiver = KVReceiver(
            self.engine.kv_cache, host=host, port=int(port), advertise_host=self._advertise_host, layout=self.layout,
            internal_token=self._internal_token, tls=self._tls,
        )
        await self.receiver.start()
        self.transfers = self.receiver
        if isinstance(self.engine, LockstepEngine) and self.engine.rank_links:
            # every rank receives its heads' slice over an endpoint of its own (TCP)
            self.transfers = RankReceivers(self.receiver, self.engine.rank_links)
            await self.transfers.start(host=host, model_id=self.model_id, advertise_host=self._advertise_host,
                                       internal_token=self._internal_token, tls=self._tls)
        self.failure.bind()
        self.async_engine = AsyncEngine(self.engine, on_step=self.delivery.on_step, on_failure=self.failure.report)

    async def failed(self) -> BaseException:
        """The engine's error once it failed (`run_service`'s fatal: the worker then ends)."""
        return await self.failure.wait()

    async def drain(self) -> None:
        """Refuse new requests (Admit, a local Start), let the held ones finish and their
        last deltas go out, then end the gateways' streams cleanly (`cleave.rpc.Drainable`)."""
        self.gate.close()
        self.admissions.queue.fail_all(self.gate.error())  # waiting for blocks: not admitted yet
        await wait_until(lambda: self.admissions.is_empty and self.streams.is_flushed())
        self.streams.close()

    async def shutdown(self) -> None:
        self.streams.close()
        self.admissions.abort_all()
        if isinstance(self.transfers, RankReceivers):
            await self.transfers.close()  # before the engine closes the ranks' pipes
        if self.receiver is not None:
            await self.receiver.close()
        if self.async_engine is not None:
            await self.async_engine.shutdown()  # closes the engine on its step thread
        elif self.engine is not None:
            self.engine.close()  # loaded, never driven: still stop its other ranks
        self.peers.close()

    def _require_engine(self) -> tuple[LLMEngine, AsyncEngine, KVReceiver | RankReceivers]:
        if self.engine is None or self.async_engine is None or self.transfers is None:
            raise FailedPrecondition("the decode worker is still loading its model; retry shortly")
        if not self.async_engine.is_running:
            raise Unavailable("the decode worker's engine stopped")
        return self.engine, self.async_engine, self.transfers

    # ---- streams --------------------------------------------------------------------------

    def attach(self, gateway_id: str) -> AsyncIterator[StepOutput]:
        self._require_engine()
        return self.streams.attach(gateway_id)

    # ---- admission, start and abort: `Admissions` ----------------------------------------

    async def admit(self, spec: AdmitSpec) -> TransferHandle:
        return await self.admissions.admit(spec)

    async def start_request(self, spec: StartSpec) -> int:
        return await self.admissions.start_request(spec)

    async def abort(self, request_id: str, sample_index: int | None = None) -> bool:
        return await self.admissions.abort(request_id, sample_index)

    def _abort_gateway(self, gateway_id: str) -> None:
        """The gateway's stream ended: nobody receives these requests' tokens any more."""
        self.admissions.abort_gateway(gateway_id)

    def _end_request(self, gateway_id: str, delta: RequestDelta) -> None:
        self.delivery.end_request(gateway_id, delta)

    # ---- load and handshake ---------------------------------------------------------------

    def load(self) -> WorkerLoad:
        if self.engine is None:
            return WorkerLoad(worker_id=self.worker_id)
        started, scheduler = self.admissions.num_started, self.engine.scheduler
        kv = self.engine.handoff.snapshot()
        return WorkerLoad(
            worker_id=self.worker_id,
            num_running=scheduler.num_running,
            # admitted and not started, queued for blocks, or started and waiting for a seat
            num_waiting=(self.admissions.num_held - started + self.admissions.queue.num_waiting
                         + scheduler.num_waiting_for_seat),
            num_free_blocks=kv.num_free_blocks,
            num_total_blocks=kv.num_usable_blocks,
            max_num_running=self.engine.config.scheduler.max_num_seqs,
            tokens_per_second=self.delivery.tokens_per_second(),
            num_attached_gateways=self.streams.num_attached,
        )

    async def handshake(self, spec: HandshakeSpec) -> HandshakeResult:
        engine, _, _ = self._require_engine()
        assert self.layout is not None and self.receiver is not None
        return await self.peers.handshake(spec, engine.kv_cache.device, self.receiver, self.layout)
