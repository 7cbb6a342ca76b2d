from cleave.proto.cleave.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PrefillRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "destination", "store_to_kvstore", "model", "decode")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    DESTINATION_FIELD_NUMBER: _ClassVar[int]
    STORE_TO_KVSTORE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    DECODE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    destination: _common_pb2.TransferHandle
    store_to_kvstore: bool
    model: str
    decode: DecodeTarget
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., destination: _Optional[_Union[_common_pb2.TransferHandle, _Mapping]] = ..., store_to_kvstore: _Optional[bool] = ..., model: _Optional[str] = ..., decode: _Optional[_Union[DecodeTarget, _Mapping]] = ...) -> None: ...

class DecodeTarget(_message.Message):
    __slots__ = ("address", "gateway_id", "reasoning")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    GATEWAY_ID_FIELD_NUMBER: _ClassVar[int]
    REASONING_FIELD_NUMBER: _ClassVar[int]
    address: str
    gateway_id: str
    reasoning: _common_pb2.ReasoningOptions
    def __init__(self, address: _Optional[str] = ..., gateway_id: _Optional[str] = ..., reasoning: _Optional[_Union[_common_pb2.ReasoningOptions, _Mapping]] = ...) -> None: ...

class TransferStats(_message.Message):
    __slots__ = ("transport", "num_bytes", "seconds", "num_blocks")
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    NUM_BYTES_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    transport: _common_pb2.TransportKind
    num_bytes: int
    seconds: float
    num_blocks: int
    def __init__(self, transport: _Optional[_Union[_common_pb2.TransportKind, str]] = ..., num_bytes: _Optional[int] = ..., seconds: _Optional[float] = ..., num_blocks: _Optional[int] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("request_id", "first_token_ids", "first_token_logprobs", "num_prompt_tokens", "num_cached_tokens", "num_computed_tokens", "transfer", "prompt_logprobs")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    first_token_ids: _containers.RepeatedScalarFieldContainer[int]
    first_token_logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TopLogprobs]
    num_prompt_tokens: int
    num_cached_tokens: int
    num_computed_tokens: int
    transfer: TransferStats
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TopLogprobs]
    def __init__(self, request_id: _Optional[str] = ..., first_token_ids: _Optional[_Iterable[int]] = ..., first_token_logprobs: _Optional[_Iterable[_Union[_common_pb2.TopLogprobs, _Mapping]]] = ..., num_prompt_tokens: _Optional[int] = ..., num_cached_tokens: _Optional[int] = ..., num_computed_tokens: _Optional[int] = ..., transfer: _Optional[_Union[TransferStats, _Mapping]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[_common_pb2.TopLogprobs, _Mapping]]] = ...) -> None: ...
