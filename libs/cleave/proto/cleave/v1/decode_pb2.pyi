from cleave.proto.cleave.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class AdmitRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "gateway_id", "prefill_worker_id")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    GATEWAY_ID_FIELD_NUMBER: _ClassVar[int]
    PREFILL_WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    gateway_id: str
    prefill_worker_id: str
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., gateway_id: _Optional[str] = ..., prefill_worker_id: _Optional[str] = ...) -> None: ...

class AdmitResponse(_message.Message):
    __slots__ = ("handle",)
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    handle: _common_pb2.TransferHandle
    def __init__(self, handle: _Optional[_Union[_common_pb2.TransferHandle, _Mapping]] = ...) -> None: ...

class StartRequest(_message.Message):
    __slots__ = ("request_id", "first_token_ids", "first_token_logprobs", "prefill_locally", "prompt_token_ids", "sampling", "reasoning", "gateway_id", "first_tokens_delivered")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_LOCALLY_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    REASONING_FIELD_NUMBER: _ClassVar[int]
    GATEWAY_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKENS_DELIVERED_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    first_token_ids: _containers.RepeatedScalarFieldContainer[int]
    first_token_logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TopLogprobs]
    prefill_locally: bool
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    reasoning: _common_pb2.ReasoningOptions
    gateway_id: str
    first_tokens_delivered: bool
    def __init__(self, request_id: _Optional[str] = ..., first_token_ids: _Optional[_Iterable[int]] = ..., first_token_logprobs: _Optional[_Iterable[_Union[_common_pb2.TopLogprobs, _Mapping]]] = ..., prefill_locally: _Optional[bool] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., reasoning: _Optional[_Union[_common_pb2.ReasoningOptions, _Mapping]] = ..., gateway_id: _Optional[str] = ..., first_tokens_delivered: _Optional[bool] = ...) -> None: ...

class StartResponse(_message.Message):
    __slots__ = ("num_cached_tokens",)
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    num_cached_tokens: int
    def __init__(self, num_cached_tokens: _Optional[int] = ...) -> None: ...

class AttachRequest(_message.Message):
    __slots__ = ("gateway_id",)
    GATEWAY_ID_FIELD_NUMBER: _ClassVar[int]
    gateway_id: str
    def __init__(self, gateway_id: _Optional[str] = ...) -> None: ...

class RequestDelta(_message.Message):
    __slots__ = ("request_id", "sample_index", "token_ids", "finish_reason", "logprobs", "error", "num_reasoning_tokens", "prompt_logprobs")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_INDEX_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    NUM_REASONING_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    sample_index: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    finish_reason: _common_pb2.FinishReason
    logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TopLogprobs]
    error: _common_pb2.ErrorDetail
    num_reasoning_tokens: int
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TopLogprobs]
    def __init__(self, request_id: _Optional[str] = ..., sample_index: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., finish_reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ..., logprobs: _Optional[_Iterable[_Union[_common_pb2.TopLogprobs, _Mapping]]] = ..., error: _Optional[_Union[_common_pb2.ErrorDetail, _Mapping]] = ..., num_reasoning_tokens: _Optional[int] = ..., prompt_logprobs: _Optional[_Iterable[_Union[_common_pb2.TopLogprobs, _Mapping]]] = ...) -> None: ...

class StepOutput(_message.Message):
    __slots__ = ("step", "deltas", "load")
    STEP_FIELD_NUMBER: _ClassVar[int]
    DELTAS_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    step: int
    deltas: _containers.RepeatedCompositeFieldContainer[RequestDelta]
    load: _common_pb2.WorkerLoad
    def __init__(self, step: _Optional[int] = ..., deltas: _Optional[_Iterable[_Union[RequestDelta, _Mapping]]] = ..., load: _Optional[_Union[_common_pb2.WorkerLoad, _Mapping]] = ...) -> None: ...

class HandshakeRequest(_message.Message):
    __slots__ = ("peer_id", "supported_transports", "host", "gpu_uuids", "nccl_unique_id", "layout")
    PEER_ID_FIELD_NUMBER: _ClassVar[int]
    SUPPORTED_TRANSPORTS_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    GPU_UUIDS_FIELD_NUMBER: _ClassVar[int]
    NCCL_UNIQUE_ID_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    peer_id: str
    supported_transports: _containers.RepeatedScalarFieldContainer[_common_pb2.TransportKind]
    host: str
    gpu_uuids: _containers.RepeatedScalarFieldContainer[str]
    nccl_unique_id: bytes
    layout: _common_pb2.KVLayout
    def __init__(self, peer_id: _Optional[str] = ..., supported_transports: _Optional[_Iterable[_Union[_common_pb2.TransportKind, str]]] = ..., host: _Optional[str] = ..., gpu_uuids: _Optional[_Iterable[str]] = ..., nccl_unique_id: _Optional[bytes] = ..., layout: _Optional[_Union[_common_pb2.KVLayout, _Mapping]] = ...) -> None: ...

class HandshakeResponse(_message.Message):
    __slots__ = ("transport", "rank", "world_size", "tcp_address", "layout", "worker_id")
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    TCP_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    transport: _common_pb2.TransportKind
    rank: int
    world_size: int
    tcp_address: str
    layout: _common_pb2.KVLayout
    worker_id: str
    def __init__(self, transport: _Optional[_Union[_common_pb2.TransportKind, str]] = ..., rank: _Optional[int] = ..., world_size: _Optional[int] = ..., tcp_address: _Optional[str] = ..., layout: _Optional[_Union[_common_pb2.KVLayout, _Mapping]] = ..., worker_id: _Optional[str] = ...) -> None: ...
