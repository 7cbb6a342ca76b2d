"""A prefill worker's side of one request's decode worker: reserve there, start there.

With a `DecodeTarget`, the gateway makes one call (Prefill) and the prefill worker drives
the decode worker, so nothing on the first token's path waits for a hop it could overlap:

    Decode.Admit    sent as the request arrives; the blocks are reserved while the prompt
                    is fetched from the kvstore and computed (`reserved()` awaits it only
                    when the KV is ready to go)
    KV send         into the reserved blocks (the caller)
    Decode.Start    the first tokens, with `first_tokens_delivered`: sent in the background,
                    so the Prefill response (which carries the first tokens to the gateway,
                    which streams them at once) does not wait for the decode engine's step
    Decode.Abort    on any failure or cancellation after Admit was sent, so the decode
                    worker frees the reservation now, not at its transfer deadline

Errors from the decode worker keep their status (RESOURCE_EXHAUSTED: no free blocks there);
one that says the decode worker is unreachable, or a call to it that ran past
`CONTROL_TIMEOUT_S` (it did not answer: hung, or its admissions queue never moved), becomes
UNAVAILABLE with field "decode": the gateway moves the request to another decode worker and
does not take this prefill worker out of rotation for it. That timeout is this hop's, not
the client's deadline, so it is never reported as DEADLINE_EXCEEDED. An Admit of a request
with a deadline (`PrefillSpec.deadline`, from the Prefill call's) waits until then instead:
in a full decode worker's admissions queue a request waits as long as its client lets it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence

import grpc
import structlog

from cleave.errors import CleaveError, Unavailable
from cleave.proto.cleave.v1 import common_pb2, decode_pb2, decode_pb2_grpc
from cleave.rpc.client import aio_channel, tls_credentials
from cleave.rpc.convert import reasoning_to_proto, sampling_to_proto, top_logprobs_to_proto, transfer_handle_from_proto
from cleave.rpc.errors import error_type_for
from cleave.rpc.types import TopLogprobs, TransferHandle
from cleave.tls import TlsConfig
from services.prefill.backend import PrefillSpec

log = structlog.get_logger("cleave.prefill")
CONTROL_TIMEOUT_S = 30.0  # Admit, Start and Abort on the decode worker
Spawn = Callable[[Awaitable[object]], None]


class DecodeLinks:
    """One channel per decode worker address, opened on first use, closed at shutdown."""

    def __init__(self, internal_token: str | None = None, *, tls: TlsConfig | None = None) -> None:
        self._internal_token = internal_token
        self._tls = tls
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._stubs: dict[str, decode_pb2_grpc.DecodeStub] = {}

    def stub(self, address: str) -> decode_pb2_grpc.DecodeStub:
        stub = self._stubs.get(address)
        if stub is None:
            channel = self._channels[address] = aio_channel(address, internal_token=self._internal_token,
                                                            credentials=tls_credentials(self._tls))
            stub = self._stubs[address] = decode_pb2_grpc.DecodeStub(channel)
        return stub

    async def close(self) -> None:
        channels, self._channels, self._stubs = self._channels, {}, {}
        await asyncio.gather(*(channel.close() for channel in channels.values()), return_exceptions=True)


def decode_error(error: grpc.aio.AioRpcError, method: str, address: str) -> CleaveError:
    """A decode worker's failed call as the error this prefill call ends with."""
    where = f"{method} on decode worker {address}"
    error_type = error_type_for(error.code())
    if error.code() is grpc.StatusCode.DEADLINE_EXCEEDED:
        error_type = None  # this hop's own timeout (module docstring): the decode worker failed
    if error_type is not None:
        return error_type(f"{where}: {error.details()}")
    return Unavailable(f"{where} failed ({error.code().name}: {error.details()}); retry", field="decode")


class DecodeHandoff:
    """Admit, Start and (on failure) Abort of one request on its `spec.decode` worker.

    Args:
        links: the worker's decode channels.
        spec: the prefill request (`spec.decode` set).
        worker_id: this prefill worker's id (the decode worker picks the transport it
            negotiated with it).
        spawn: runs a background task the worker tracks until shutdown.
    """

    def __init__(self, links: DecodeLinks, spec: PrefillSpec, worker_id: str, spawn: Spawn) -> None:
        assert spec.decode is not None
        self.spec = spec
        self.target = spec.decode
        self.worker_id = worker_id
        self._stub = links.stub(spec.decode.address)
        self._spawn = spawn
        self._admit: asyncio.Task[TransferHandle] | None = None
        self._ended = False  # started or aborted: nothing more to send

    def admit(self) -> None:
        """Send Admit now; `reserved()` awaits its answer."""
        spec = self.spec
        request = decode_pb2.AdmitRequest(
            request_id=spec.request_id, prompt_token_ids=spec.prompt_token_ids,
            sampling=sampling_to_proto(spec.sampling), gateway_id=self.target.gateway_id,
            prefill_worker_id=self.worker_id,
        )
        self._admit = asyncio.ensure_future(self._call_admit(request))

    async def _call_admit(self, request: decode_pb2.AdmitRequest) -> TransferHandle:
        deadline = self.spec.deadline
        # an Admit may wait in the decode worker's queue for KV blocks as long as the caller
        # lets the request wait (a hung decode worker is the gateway's to detect: it gives
        # the Prefill up, which cancels this)
        timeout = CONTROL_TIMEOUT_S if deadline is None else max(deadline - asyncio.get_running_loop().time(), 0.0)
        try:
            response = await self._stub.Admit(request, timeout=timeout)
        except grpc.aio.AioRpcError as error:
            raise decode_error(error, "Admit", self.target.address) from None
        return transfer_handle_from_proto(response.handle)

    async def reserved(self) -> TransferHandle:
        """The decode worker's reserved blocks (raises the decode worker's refusal)."""
        assert self._admit is not None, "admit() first"
        return await asyncio.shield(self._admit)

    def start(self, first_token_ids: Sequence[int], first_token_logprobs: Sequence[TopLogprobs]) -> None:
        """Start the decode from the first tokens, in the background (the caller returns
        them to the gateway meanwhile). A failed Start ends the request on the decode
        worker, which reports it on the gateway's stream."""
        self._ended = True
        spec = self.spec
        request = decode_pb2.StartRequest(
            request_id=spec.request_id, first_token_ids=first_token_ids,
            first_token_logprobs=top_logprobs_to_proto(first_token_logprobs),
            gateway_id=self.target.gateway_id, first_tokens_delivered=True,
        )
        if self.target.reasoning is not None:
            request.reasoning.CopyFrom(reasoning_to_proto(self.target.reasoning))
        self._spawn(self._call_start(request))

    async def _call_start(self, request: decode_pb2.StartRequest) -> None:
        try:
            await self._stub.Start(request, timeout=CONTROL_TIMEOUT_S)
        except grpc.aio.AioRpcError as error:
            log.warning("decode start failed", request_id=request.request_id, decode=self.target.address,
                        code=error.code().name, error=error.details())
            self._spawn(self._call_abort())

    def abort(self) -> None:
        """Free the decode worker's reservation (once Admit answered, if it was sent)."""
        if self._ended or self._admit is None:
            return
        self._ended = True

        def after_admit(task: asyncio.Task[TransferHandle]) -> None:
            if not task.cancelled() and task.exception() is None:
                self._spawn(self._call_abort())

        if self._admit.done():
            after_admit(self._admit)
        else:
            self._admit.add_done_callback(after_admit)

    async def _call_abort(self) -> None:
        try:
            await self._stub.Abort(common_pb2.AbortRequest(request_id=self.spec.request_id), timeout=CONTROL_TIMEOUT_S)
        except grpc.aio.AioRpcError as error:  # its transfer deadline frees the blocks then
            log.warning("decode abort failed", request_id=self.spec.request_id, decode=self.target.address,
                        code=error.code().name, error=error.details())
