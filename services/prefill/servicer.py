"""cleave.v1.Prefill servicer: protobuf <-> `services.prefill.backend` types, nothing else."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import grpc

from cleave.errors import InvalidArgument
from cleave.proto.cleave.v1 import common_pb2, prefill_pb2, prefill_pb2_grpc
from cleave.rpc.convert import (
    reasoning_from_proto,
    require_request_id,
    sampling_from_proto,
    token_ids_from_proto,
    top_logprobs_to_proto,
    transfer_handle_from_proto,
    transport_to_proto,
    worker_load_to_proto,
)
from cleave.rpc.types import TransferStats
from services.prefill.backend import DecodeTarget, PrefillBackend, PrefillResult, PrefillSpec


def prefill_spec_from_proto(request: prefill_pb2.PrefillRequest, model_id: str) -> PrefillSpec:
    if request.model and request.model != model_id:
        raise InvalidArgument(
            f"this worker serves {model_id!r}, not {request.model!r}", field="model"
        )
    decode = decode_target_from_proto(request) if request.HasField("decode") else None
    return PrefillSpec(
        request_id=require_request_id(request.request_id),
        prompt_token_ids=token_ids_from_proto(request.prompt_token_ids, "prompt_token_ids"),
        sampling=sampling_from_proto(request.sampling),  # unset: server defaults
        destination=transfer_handle_from_proto(request.destination)
        if request.HasField("destination")
        else None,
        store_to_kvstore=request.store_to_kvstore,
        decode=decode,
    )


def decode_target_from_proto(request: prefill_pb2.PrefillRequest) -> DecodeTarget:
    target = request.decode
    if request.HasField("destination"):
        raise InvalidArgument("give either destination or decode, not both", field="decode")
    if not target.address:
        raise InvalidArgument("must be set", field="decode.address")
    if not target.gateway_id:
        raise InvalidArgument("must be set", field="decode.gateway_id")
    return DecodeTarget(
        address=target.address,
        gateway_id=target.gateway_id,
        reasoning=reasoning_from_proto(target.reasoning) if target.HasField("reasoning") else None,
    )


def prefill_result_to_proto(result: PrefillResult, request_id: str) -> prefill_pb2.PrefillResponse:
    response = prefill_pb2.PrefillResponse(
        request_id=request_id,
        first_token_ids=result.first_token_ids,
        first_token_logprobs=top_logprobs_to_proto(result.first_token_logprobs),
        prompt_logprobs=top_logprobs_to_proto(result.prompt_logprobs),
        num_prompt_tokens=result.num_prompt_tokens,
        num_cached_tokens=result.num_cached_tokens,
        num_computed_tokens=result.num_computed_tokens,
    )
    if result.transfer is not None:
        response.transfer.CopyFrom(transfer_stats_to_proto(result.transfer))
    return response


def transfer_stats_to_proto(transfer: TransferStats) -> prefill_pb2.TransferStats:
    return prefill_pb2.TransferStats(
        transport=transport_to_proto(transfer.transport),
        num_bytes=transfer.num_bytes,
        seconds=transfer.seconds,
        num_blocks=transfer.num_blocks,
    )


class PrefillServicer(prefill_pb2_grpc.PrefillServicer):
    """Validates prefill requests and hands them to a PrefillBackend."""

    def __init__(self, backend: PrefillBackend, model_id: str) -> None:
        self.backend = backend
        self.model_id = model_id

    async def Prefill(self, request: prefill_pb2.PrefillRequest, context: grpc.aio.ServicerContext) -> None:
        """One message with everything, or (with `decode`) the first tokens at once and the
        transfer once the KV is delivered (see the proto)."""
        spec = prefill_spec_from_proto(request, self.model_id)
        remaining = context.time_remaining()
        if remaining is not None:
            spec = replace(spec, deadline=asyncio.get_running_loop().time() + remaining)
        sent_early = False

        async def early(first: PrefillResult) -> None:
            nonlocal sent_early
            await context.write(prefill_result_to_proto(first, spec.request_id))
            sent_early = True

        result = await self.backend.prefill(spec, early if spec.decode is not None else None)
        if not sent_early:
            await context.write(prefill_result_to_proto(result, spec.request_id))
            return
        delivered = prefill_pb2.PrefillResponse(request_id=spec.request_id)
        if result.transfer is not None:
            delivered.transfer.CopyFrom(transfer_stats_to_proto(result.transfer))
        await context.write(delivered)

    async def GetLoad(
        self, request: common_pb2.GetLoadRequest, context: grpc.aio.ServicerContext
    ) -> common_pb2.GetLoadResponse:
        return common_pb2.GetLoadResponse(load=worker_load_to_proto(self.backend.load()))
