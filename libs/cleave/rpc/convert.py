"""Protobuf <-> domain types (`cleave.rpc.types`, the engine's `SamplingParams` and
`FinishReason`), with validation of everything a client can send.

`*_from_proto` functions raise `cleave.errors.InvalidArgument` naming the dotted field path
(e.g. "sampling.top_p"), which the rpc interceptor turns into INVALID_ARGUMENT.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence, Sized
from typing import Any

import grpc
from google.protobuf.timestamp_pb2 import Timestamp

from cleave.errors import InvalidArgument
from cleave.generation.outputs import FinishReason
from cleave.generation.sampling_params import (
    MAX_LOGIT_BIAS_TOKENS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    SamplingParams,
)
from cleave.generation.sampling_request import MAX_SAMPLES, MAX_TOKEN_ID, SamplingRequest, to_sampling_params
from cleave.generation.structured_output import MAX_CHOICES, StructuredKind, StructuredOutput
from cleave.proto.cleave.v1 import common_pb2
from cleave.rpc import types
from cleave.rpc.errors import error_code_for
from cleave.rpc.interceptor import MAX_REQUEST_ID_CHARS


DTYPE_ITEMSIZE = {
    "float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1,
    "int8": 1, "uint8": 1, "int32": 4, "int64": 8,
}
_DTYPE_TO_PROTO = {name: common_pb2.DType.Value(f"DTYPE_{name.upper()}") for name in DTYPE_ITEMSIZE}
_DTYPE_FROM_PROTO = {value: name for name, value in _DTYPE_TO_PROTO.items()}
_FINISH_TO_PROTO = {
    reason: common_pb2.FinishReason.Value(f"FINISH_REASON_{reason.name}")
    for reason in FinishReason
}
_FINISH_FROM_PROTO = {value: reason for reason, value in _FINISH_TO_PROTO.items()}
_TRANSPORT_TO_PROTO = {
    kind: common_pb2.TransportKind.Value(f"TRANSPORT_KIND_{kind.name}")
    for kind in types.TransportKind
}
_TRANSPORT_FROM_PROTO = {value: kind for kind, value in _TRANSPORT_TO_PROTO.items()}
_REASONING_FROM_PROTO = {
    common_pb2.REASONING_MODE_UNSPECIFIED: types.ReasoningMode.DEFAULT,
    common_pb2.REASONING_MODE_SEPARATE: types.ReasoningMode.SEPARATE,
    common_pb2.REASONING_MODE_HIDDEN: types.ReasoningMode.HIDDEN,
    common_pb2.REASONING_MODE_INLINE: types.ReasoningMode.INLINE,
}
_REASONING_TO_PROTO = {mode: value for value, mode in _REASONING_FROM_PROTO.items()}


def _optional(message, name: str):
    return getattr(message, name) if message.HasField(name) else None


def at_most(values: Sized, limit: int, field: str, what: str) -> None:
    """Refuse a repeated field of more than `limit` elements, named `field`; call it before
    the elements are converted."""
    if len(values) > limit:
        raise InvalidArgument(f"holds {len(values)} {what}; at most {limit}", field=field)


def token_ids_from_proto(ids: Sequence[int], field: str, allow_empty: bool = False,
                         max_count: int | None = None, first_position: int = 0) -> tuple[int, ...]:
    """Validated token ids (uint32 on the wire; must fit int32 for the engine), at most
    `max_count` of them: counted before they are converted, since a message may hold millions.
    `first_position`: where `ids` starts in the field (errors name the field's positions), for
    ids read from a field's end."""
    if max_count is not None:
        at_most(ids, max_count, field, "token ids")
    token_ids = tuple(ids)
    if not token_ids and not allow_empty:
        raise InvalidArgument("must contain at least one token id", field=field)
    for position, token_id in enumerate(token_ids, start=first_position):
        if token_id > MAX_TOKEN_ID:
            raise InvalidArgument(f"token id {token_id} is out of range", field=f"{field}[{position}]")
    return token_ids


def sampling_from_proto(
    message: common_pb2.SamplingParams,
    field: str = "sampling",
    reasoning: types.ReasoningOptions | None = None,
) -> SamplingParams:
    """Validate SamplingParams into the engine's type (`to_sampling_params`, the validator
    the HTTP API shares); unset fields take the engine defaults (temperature, top_p and
    repetition_penalty 1.0; max_tokens 0 -> None: fill the context). `reasoning` adds the
    thinking budget and whether reasoning text is returned."""
    # counted before they are converted: a message may hold millions of tiny elements, and
    # converting them one by one held the event loop for seconds before the validator's refusal
    at_most(message.stop, MAX_STOP_STRINGS, f"{field}.stop", "strings")
    at_most(message.logit_bias, MAX_LOGIT_BIAS_TOKENS, f"{field}.logit_bias", "biased tokens")
    request = SamplingRequest(
        max_tokens=message.max_tokens or None,
        min_tokens=message.min_tokens,
        temperature=_optional(message, "temperature"),
        top_p=_optional(message, "top_p"),
        top_k=message.top_k,
        min_p=message.min_p,
        seed=_optional(message, "seed"),
        stop=tuple(message.stop),
        stop_token_ids=token_ids_from_proto(message.stop_token_ids, f"{field}.stop_token_ids", allow_empty=True,
                                            max_count=MAX_STOP_TOKEN_IDS),
        n=message.n or None,
        logprobs=_optional(message, "logprobs"),
        prompt_logprobs=_optional(message, "prompt_logprobs"),
        repetition_penalty=_optional(message, "repetition_penalty"),
        frequency_penalty=message.frequency_penalty,
        presence_penalty=message.presence_penalty,
        ignore_eos=message.ignore_eos,
        skip_special_tokens=_optional(message, "skip_special_tokens"),
        logit_bias=tuple(sorted(message.logit_bias.items())),
        structured_output=structured_from_proto(message.structured_output)
        if message.HasField("structured_output") else None,
        cache_salt=message.cache_salt,
        priority=message.priority,
    )
    if reasoning is None:
        return to_sampling_params(request, field)
    return to_sampling_params(request, field, **thinking_options(reasoning))


def structured_from_proto(message: common_pb2.StructuredOutput, field: str = "sampling.structured_output"
                          ) -> StructuredOutput:
    """The constraint a StructuredOutput message sets (InvalidArgument when it sets none)."""
    form = message.WhichOneof("form")
    if form is None or (form == "json_object" and not message.json_object):
        raise InvalidArgument("set one of json_schema, json_object, regex, choice or grammar", field=field)
    if form == "choice":
        at_most(message.choice.choices, MAX_CHOICES, field, "choices")  # before they are converted
        return StructuredOutput(StructuredKind.CHOICE, choices=tuple(message.choice.choices))
    if form == "json_object":
        return StructuredOutput(StructuredKind.JSON_OBJECT)
    return StructuredOutput(StructuredKind(form), getattr(message, form))


def structured_to_proto(spec: StructuredOutput) -> common_pb2.StructuredOutput:
    if spec.kind is StructuredKind.CHOICE:
        return common_pb2.StructuredOutput(choice=common_pb2.StringChoices(choices=spec.choices))
    if spec.kind is StructuredKind.JSON_OBJECT:
        return common_pb2.StructuredOutput(json_object=True)
    return common_pb2.StructuredOutput(**{spec.kind.value: spec.spec})


def thinking_options(options: types.ReasoningOptions) -> dict[str, Any]:
    """`to_sampling_params`'s thinking keywords from a request's reasoning options."""
    return {"max_thinking_tokens": options.max_thinking_tokens,
            "min_thinking_tokens": options.min_thinking_tokens or 0,
            "include_reasoning": options.mode is not types.ReasoningMode.HIDDEN}


def apply_reasoning(params: SamplingParams, options: types.ReasoningOptions) -> SamplingParams:
    """Copy thinking budgets and the reasoning mode into `params` (in place; returned)."""
    for name, value in thinking_options(options).items():
        setattr(params, name, value)
    return params


def sampling_to_proto(params: SamplingParams) -> common_pb2.SamplingParams:
    """The wire form of the engine's SamplingParams (thinking fields travel in
    ReasoningOptions, see `reasoning_to_proto`)."""
    message = common_pb2.SamplingParams(
        max_tokens=params.max_tokens or 0,
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=max(params.top_k, 0),
        min_p=params.min_p,
        stop=params.stop,
        stop_token_ids=params.stop_token_ids,
        n=params.n,
        repetition_penalty=params.repetition_penalty,
        frequency_penalty=params.frequency_penalty,
        presence_penalty=params.presence_penalty,
        ignore_eos=params.ignore_eos,
        skip_special_tokens=params.skip_special_tokens,
        min_tokens=params.min_tokens,
        logit_bias=params.logit_bias or {},
        cache_salt=params.cache_salt,
        priority=params.priority,
    )
    if params.structured_output is not None:
        message.structured_output.CopyFrom(structured_to_proto(params.structured_output))
    for name in ("seed", "logprobs", "prompt_logprobs"):
        value = getattr(params, name)
        if value is not None:
            setattr(message, name, value)
    return message


def reasoning_from_proto(
    message: common_pb2.ReasoningOptions, field: str = "reasoning"
) -> types.ReasoningOptions:
    if message.mode not in _REASONING_FROM_PROTO:
        raise InvalidArgument(f"unknown reasoning mode {message.mode}", field=f"{field}.mode")
    max_thinking = _optional(message, "max_thinking_tokens")
    min_thinking = _optional(message, "min_thinking_tokens")
    if max_thinking is not None and min_thinking is not None and min_thinking > max_thinking:
        raise InvalidArgument("must not exceed max_thinking_tokens", field=f"{field}.min_thinking_tokens")
    return types.ReasoningOptions(
        mode=_REASONING_FROM_PROTO[message.mode],
        max_thinking_tokens=max_thinking,
        min_thinking_tokens=min_thinking,
        enable_thinking=_optional(message, "enable_thinking"),
        reasoning_effort=checked_reasoning_effort(_optional(message, "reasoning_effort"), f"{field}.reasoning_effort"),
    )


def checked_reasoning_effort(value: Any, field: str) -> str | None:
    """`value` as a request's reasoning effort (None: unset), else InvalidArgument naming `field`."""
    if value is not None and value not in types.REASONING_EFFORTS:
        raise InvalidArgument(f"must be one of {', '.join(types.REASONING_EFFORTS)}, got {value!r}", field=field)
    return value


def reasoning_to_proto(options: types.ReasoningOptions) -> common_pb2.ReasoningOptions:
    message = common_pb2.ReasoningOptions(mode=_REASONING_TO_PROTO[options.mode])
    for name in ("max_thinking_tokens", "min_thinking_tokens", "enable_thinking", "reasoning_effort"):
        value = getattr(options, name)
        if value is not None:
            setattr(message, name, value)
    return message


def finish_reason_to_proto(reason: FinishReason | None) -> int:
    return common_pb2.FINISH_REASON_UNSPECIFIED if reason is None else _FINISH_TO_PROTO[reason]


def finish_reason_from_proto(value: int) -> FinishReason | None:
    return _FINISH_FROM_PROTO.get(value)


def top_logprobs_to_proto(entries: Sequence[types.TopLogprobs]) -> list[common_pb2.TopLogprobs]:
    def one(entry: types.TokenLogprob) -> common_pb2.TokenLogprob:
        return common_pb2.TokenLogprob(
            token_id=entry.token_id, logprob=entry.logprob, text=entry.text, rank=entry.rank
        )

    return [
        common_pb2.TopLogprobs(sampled=one(e.sampled), top=[one(t) for t in e.top]) for e in entries
    ]


def top_logprobs_from_proto(messages: Iterable[common_pb2.TopLogprobs]) -> tuple[types.TopLogprobs, ...]:
    def one(message: common_pb2.TokenLogprob) -> types.TokenLogprob:
        return types.TokenLogprob(message.token_id, message.logprob, message.text, message.rank)

    return tuple(types.TopLogprobs(one(m.sampled), tuple(one(t) for t in m.top)) for m in messages)


def usage_to_proto(usage: types.Usage) -> common_pb2.Usage:
    return common_pb2.Usage(
        prompt_tokens=usage.prompt_tokens,
        completion_tokens=usage.completion_tokens,
        reasoning_tokens=usage.reasoning_tokens,
        cached_prompt_tokens=usage.cached_prompt_tokens,
    )


def dtype_from_proto(value: int, field: str) -> str:
    if value not in _DTYPE_FROM_PROTO:
        raise InvalidArgument("dtype must be set to a known DType", field=field)
    return _DTYPE_FROM_PROTO[value]


def dtype_to_proto(name: str) -> int:
    if name not in _DTYPE_TO_PROTO:
        raise ValueError(f"dtype {name!r} has no wire form; use one of {sorted(_DTYPE_TO_PROTO)}")
    return _DTYPE_TO_PROTO[name]


def tensor_from_proto(message: common_pb2.Tensor, field: str) -> types.TensorBytes:
    """Validate that data holds exactly prod(shape) elements of dtype."""
    dtype = dtype_from_proto(message.dtype, f"{field}.dtype")
    shape = tuple(message.shape)
    if any(size < 0 for size in shape):
        raise InvalidArgument(f"negative dimension in {list(shape)}", field=f"{field}.shape")
    expected = math.prod(shape) * DTYPE_ITEMSIZE[dtype]
    data = message.data  # each read of a bytes field copies it
    if len(data) != expected:
        raise InvalidArgument(
            f"holds {len(data)} bytes but shape {list(shape)} of {dtype} needs {expected}",
            field=f"{field}.data",
        )
    return types.TensorBytes(dtype=dtype, shape=shape, data=data)


def tensor_to_proto(tensor: types.TensorBytes) -> common_pb2.Tensor:
    return common_pb2.Tensor(
        dtype=dtype_to_proto(tensor.dtype), shape=tensor.shape, data=bytes(tensor.data)
    )


def kv_layout_from_proto(message: common_pb2.KVLayout, field: str = "layout") -> types.KVLayout:
    if not message.model_id:
        raise InvalidArgument("must name the model", field=f"{field}.model_id")
    for name in ("block_size", "num_layers", "num_kv_heads", "head_dim"):
        if getattr(message, name) == 0:
            raise InvalidArgument("must be > 0", field=f"{field}.{name}")
    total = message.total_kv_heads or message.num_kv_heads
    if message.kv_head_start + message.num_kv_heads > total:
        raise InvalidArgument(
            f"heads {message.kv_head_start}..{message.kv_head_start + message.num_kv_heads - 1} are not among "
            f"the model's {total}", field=f"{field}.kv_head_start")
    return types.KVLayout(
        model_id=message.model_id,
        dtype=dtype_from_proto(message.dtype, f"{field}.dtype"),
        block_size=message.block_size,
        num_layers=message.num_layers,
        num_kv_heads=message.num_kv_heads,
        head_dim=message.head_dim,
        hash_namespace=message.hash_namespace,
        kv_head_start=message.kv_head_start,
        total_kv_heads=message.total_kv_heads,
    )


def kv_layout_to_proto(layout: types.KVLayout) -> common_pb2.KVLayout:
    return common_pb2.KVLayout(
        model_id=layout.model_id,
        dtype=dtype_to_proto(layout.dtype),
        block_size=layout.block_size,
        num_layers=layout.num_layers,
        num_kv_heads=layout.num_kv_heads,
        head_dim=layout.head_dim,
        hash_namespace=layout.hash_namespace,
        kv_head_start=layout.kv_head_start,
        total_kv_heads=layout.total_kv_heads,
    )


def transport_from_proto(value: int, field: str) -> types.TransportKind:
    if value not in _TRANSPORT_FROM_PROTO:
        raise InvalidArgument("must be TCP, CUDA_IPC or NCCL", field=field)
    return _TRANSPORT_FROM_PROTO[value]


def transport_to_proto(kind: types.TransportKind) -> int:
    return _TRANSPORT_TO_PROTO[kind]


def transfer_handle_from_proto(
    message: common_pb2.TransferHandle, field: str = "destination"
) -> types.TransferHandle:
    transport = transport_from_proto(message.transport, f"{field}.transport")
    if not message.transfer_id:
        raise InvalidArgument("must be set", field=f"{field}.transfer_id")
    if not message.block_ids:
        raise InvalidArgument("must list the reserved blocks", field=f"{field}.block_ids")
    if message.num_cached_blocks > len(message.block_ids):
        raise InvalidArgument("exceeds len(block_ids)", field=f"{field}.num_cached_blocks")
    if transport is types.TransportKind.TCP and not message.address:
        raise InvalidArgument("TCP transfers need host:port", field=f"{field}.address")
    if transport is types.TransportKind.NCCL and not message.nccl_unique_id:
        raise InvalidArgument("NCCL transfers need a unique id", field=f"{field}.nccl_unique_id")
    deadline = (
        message.deadline.seconds + message.deadline.nanos / 1e9
        if message.HasField("deadline")
        else None
    )
    return types.TransferHandle(
        transport=transport,
        address=message.address,
        transfer_id=message.transfer_id,
        block_ids=tuple(message.block_ids),
        layout=kv_layout_from_proto(message.layout, f"{field}.layout")
        if message.HasField("layout")
        else None,
        nccl_unique_id=message.nccl_unique_id,
        cuda_ipc_handle=message.cuda_ipc_handle,
        device_index=_optional(message, "device_index"),
        deadline_unix_s=deadline,
        num_cached_blocks=message.num_cached_blocks,
        worker_id=message.worker_id,
        control_address=message.control_address,
        rank_handles=tuple(
            transfer_handle_from_proto(rank, f"{field}.rank_handles[{index}]")
            for index, rank in enumerate(message.rank_handles)
        ),
    )


def transfer_handle_to_proto(handle: types.TransferHandle) -> common_pb2.TransferHandle:
    message = common_pb2.TransferHandle(
        transport=transport_to_proto(handle.transport),
        address=handle.address,
        transfer_id=handle.transfer_id,
        block_ids=handle.block_ids,
        nccl_unique_id=handle.nccl_unique_id,
        cuda_ipc_handle=handle.cuda_ipc_handle,
        num_cached_blocks=handle.num_cached_blocks,
        worker_id=handle.worker_id,
        control_address=handle.control_address,
    )
    if handle.layout is not None:
        message.layout.CopyFrom(kv_layout_to_proto(handle.layout))
    message.rank_handles.extend(transfer_handle_to_proto(rank) for rank in handle.rank_handles)
    if handle.device_index is not None:
        message.device_index = handle.device_index
    if handle.deadline_unix_s is not None:
        seconds = math.floor(handle.deadline_unix_s)
        nanos = round((handle.deadline_unix_s - seconds) * 1e9)
        message.deadline.CopyFrom(Timestamp(seconds=seconds, nanos=min(nanos, 999_999_999)))
    return message


def worker_load_to_proto(load: types.WorkerLoad) -> common_pb2.WorkerLoad:
    return common_pb2.WorkerLoad(
        worker_id=load.worker_id,
        num_running=load.num_running,
        num_waiting=load.num_waiting,
        num_free_blocks=load.num_free_blocks,
        num_total_blocks=load.num_total_blocks,
        num_queued_prompt_tokens=load.num_queued_prompt_tokens,
        max_num_running=load.max_num_running,
        tokens_per_second=load.tokens_per_second,
        num_attached_gateways=load.num_attached_gateways,
    )


def worker_load_from_proto(message: common_pb2.WorkerLoad) -> types.WorkerLoad:
    return types.WorkerLoad(
        worker_id=message.worker_id,
        num_running=message.num_running,
        num_waiting=message.num_waiting,
        num_free_blocks=message.num_free_blocks,
        num_total_blocks=message.num_total_blocks,
        num_queued_prompt_tokens=message.num_queued_prompt_tokens,
        max_num_running=message.max_num_running,
        tokens_per_second=message.tokens_per_second,
        num_attached_gateways=message.num_attached_gateways,
    )


def error_info_to_proto(error: types.ErrorInfo, request_id: str) -> common_pb2.ErrorDetail:
    code = getattr(grpc.StatusCode, error.code, grpc.StatusCode.INTERNAL)
    return common_pb2.ErrorDetail(
        code=error_code_for(code), message=error.message, field=error.field, request_id=request_id
    )


def abort_target(request: common_pb2.AbortRequest) -> tuple[str, int | None]:
    """(request id, sample index or None for the whole request) of a validated AbortRequest."""
    sample_index = request.sample_index if request.HasField("sample_index") else None
    if sample_index is not None and sample_index < 0:
        raise InvalidArgument("must be a sample index, 0 or more", field="sample_index")
    return require_request_id(request.request_id), sample_index


def require_request_id(request_id: str, field: str = "request_id") -> str:
    if not request_id:
        raise InvalidArgument("must be set", field=field)
    if len(request_id) > MAX_REQUEST_ID_CHARS:
        raise InvalidArgument(f"must be at most {MAX_REQUEST_ID_CHARS} characters", field=field)
    return request_id
