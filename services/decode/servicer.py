"""cleave.v1.Decode servicer: protobuf <-> `services.decode.backend` types, nothing else."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import grpc

from cleave.errors import InvalidArgument
from cleave.proto.cleave.v1 import common_pb2, decode_pb2, decode_pb2_grpc
from cleave.rpc.convert import (
    abort_target,
    error_info_to_proto,
    finish_reason_to_proto,
    kv_layout_from_proto,
    kv_layout_to_proto,
    reasoning_from_proto,
    require_request_id,
    sampling_from_proto,
    token_ids_from_proto,
    top_logprobs_from_proto,
    top_logprobs_to_proto,
    transfer_handle_to_proto,
    transport_from_proto,
    transport_to_proto,
    worker_load_to_proto,
)
from cleave.rpc.types import StepOutput
from services.decode.backend import AdmitSpec, DecodeBackend, HandshakeSpec, StartSpec


def _require(value: str, field: str) -> str:
    if not value:
        raise InvalidArgument("must be set", field=field)
    return value


def admit_spec_from_proto(request: decode_pb2.AdmitRequest) -> AdmitSpec:
    return AdmitSpec(
        request_id=require_request_id(request.request_id),
        prompt_token_ids=token_ids_from_proto(request.prompt_token_ids, "prompt_token_ids"),
        sampling=sampling_from_proto(request.sampling),  # unset: server defaults
        gateway_id=_require(request.gateway_id, "gateway_id"),
        prefill_worker_id=request.prefill_worker_id,
    )


def start_spec_from_proto(request: decode_pb2.StartRequest) -> StartSpec:
    request_id = require_request_id(request.request_id)
    logprobs = top_logprobs_from_proto(request.first_token_logprobs)
    if request.prefill_locally:
        if request.first_token_ids:
            raise InvalidArgument("must be empty with prefill_locally", field="first_token_ids")
        prompt = token_ids_from_proto(request.prompt_token_ids, "prompt_token_ids")
        if not request.HasField("sampling"):
            raise InvalidArgument("required with prefill_locally", field="sampling")
        gateway_id = _require(request.gateway_id, "gateway_id")
    else:
        prompt = token_ids_from_proto(request.prompt_token_ids, "prompt_token_ids", allow_empty=True)
        gateway_id = request.gateway_id
        if not request.first_token_ids:
            raise InvalidArgument(
                "give the prefill worker's first tokens, or set prefill_locally",
                field="first_token_ids",
            )
    first_token_ids = token_ids_from_proto(request.first_token_ids, "first_token_ids", allow_empty=True)
    if logprobs and len(logprobs) != len(first_token_ids):
        raise InvalidArgument("needs one entry per first token", field="first_token_logprobs")
    return StartSpec(
        request_id=request_id,
        gateway_id=gateway_id,
        first_token_ids=first_token_ids,
        first_token_logprobs=logprobs,
        prefill_locally=request.prefill_locally,
        prompt_token_ids=prompt,
        sampling=sampling_from_proto(request.sampling) if request.HasField("sampling") else None,
        reasoning=reasoning_from_proto(request.reasoning)
        if request.HasField("reasoning")
        else None,
        first_tokens_delivered=request.first_tokens_delivered and not request.prefill_locally,
    )


def handshake_spec_from_proto(request: decode_pb2.HandshakeRequest) -> HandshakeSpec:
    if not request.supported_transports:
        raise InvalidArgument("list at least one transport", field="supported_transports")
    transports = tuple(
        transport_from_proto(kind, f"supported_transports[{position}]")
        for position, kind in enumerate(request.supported_transports)
    )
    return HandshakeSpec(
        peer_id=_require(request.peer_id, "peer_id"),
        supported_transports=transports,
        host=request.host,
        gpu_uuids=tuple(request.gpu_uuids),
        nccl_unique_id=request.nccl_unique_id,
        layout=kv_layout_from_proto(request.layout) if request.HasField("layout") else None,
    )


def step_output_to_proto(output: StepOutput) -> decode_pb2.StepOutput:
    message = decode_pb2.StepOutput(step=output.step)
    add = message.deltas.add
    for delta in output.deltas:
        # Only the fields a delta sets: this runs once per sample per step, and most deltas
        # are one token with no finish, logprobs or reasoning.
        entry = add(request_id=delta.request_id, sample_index=delta.sample_index, token_ids=delta.token_ids)
        if delta.finish_reason is not None:
            entry.finish_reason = finish_reason_to_proto(delta.finish_reason)
        if delta.logprobs:
            entry.logprobs.extend(top_logprobs_to_proto(delta.logprobs))
        if delta.num_reasoning_tokens:
            entry.num_reasoning_tokens = delta.num_reasoning_tokens
        if delta.prompt_logprobs:
            entry.prompt_logprobs.extend(top_logprobs_to_proto(delta.prompt_logprobs))
        if delta.error is not None:
            entry.error.CopyFrom(error_info_to_proto(delta.error, delta.request_id))
    if output.load is not None:
        message.load.CopyFrom(worker_load_to_proto(output.load))
    return message


class DecodeServicer(decode_pb2_grpc.DecodeServicer):
    """Validates decode-worker calls and hands them to a DecodeBackend."""

    def __init__(self, backend: DecodeBackend) -> None:
        self.backend = backend

    async def Admit(
        self, request: decode_pb2.AdmitRequest, context: grpc.aio.ServicerContext
    ) -> decode_pb2.AdmitResponse:
        handle = await self.backend.admit(admit_spec_from_proto(request))
        return decode_pb2.AdmitResponse(handle=transfer_handle_to_proto(handle))

    async def Start(
        self, request: decode_pb2.StartRequest, context: grpc.aio.ServicerContext
    ) -> decode_pb2.StartResponse:
        num_cached_tokens = await self.backend.start_request(start_spec_from_proto(request))
        return decode_pb2.StartResponse(num_cached_tokens=num_cached_tokens)

    async def Attach(
        self, request: decode_pb2.AttachRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[decode_pb2.StepOutput]:
        gateway_id = _require(request.gateway_id, "gateway_id")
        # Closing the backend's stream when the client goes away detaches the gateway.
        async with contextlib.aclosing(self.backend.attach(gateway_id)) as stream:
            async for output in stream:
                yield step_output_to_proto(output)

    async def Abort(
        self, request: common_pb2.AbortRequest, context: grpc.aio.ServicerContext
    ) -> common_pb2.AbortResponse:
        found = await self.backend.abort(*abort_target(request))
        return common_pb2.AbortResponse(found=found)

    async def GetLoad(
        self, request: common_pb2.GetLoadRequest, context: grpc.aio.ServicerContext
    ) -> common_pb2.GetLoadResponse:
        return common_pb2.GetLoadResponse(load=worker_load_to_proto(self.backend.load()))

    async def Handshake(
        self, request: decode_pb2.HandshakeRequest, context: grpc.aio.ServicerContext
    ) -> decode_pb2.HandshakeResponse:
        result = await self.backend.handshake(handshake_spec_from_proto(request))
        response = decode_pb2.HandshakeResponse(
            transport=transport_to_proto(result.transport),
            rank=result.rank,
            world_size=result.world_size,
            tcp_address=result.tcp_address,
            worker_id=result.worker_id,
        )
        if result.layout is not None:
            response.layout.CopyFrom(kv_layout_to_proto(result.layout))
        return response
