import datetime

from google.protobuf import timestamp_pb2 as _timestamp_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ReasoningMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    REASONING_MODE_UNSPECIFIED: _ClassVar[ReasoningMode]
    REASONING_MODE_SEPARATE: _ClassVar[ReasoningMode]
    REASONING_MODE_HIDDEN: _ClassVar[ReasoningMode]
    REASONING_MODE_INLINE: _ClassVar[ReasoningMode]

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_ABORT: _ClassVar[FinishReason]
    FINISH_REASON_ERROR: _ClassVar[FinishReason]
    FINISH_REASON_TIMEOUT: _ClassVar[FinishReason]

class ErrorCode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ERROR_CODE_UNSPECIFIED: _ClassVar[ErrorCode]
    ERROR_CODE_INVALID_ARGUMENT: _ClassVar[ErrorCode]
    ERROR_CODE_RESOURCE_EXHAUSTED: _ClassVar[ErrorCode]
    ERROR_CODE_NOT_FOUND: _ClassVar[ErrorCode]
    ERROR_CODE_FAILED_PRECONDITION: _ClassVar[ErrorCode]
    ERROR_CODE_DEADLINE_EXCEEDED: _ClassVar[ErrorCode]
    ERROR_CODE_UNAVAILABLE: _ClassVar[ErrorCode]
    ERROR_CODE_CANCELLED: _ClassVar[ErrorCode]
    ERROR_CODE_INTERNAL: _ClassVar[ErrorCode]
    ERROR_CODE_UNIMPLEMENTED: _ClassVar[ErrorCode]
    ERROR_CODE_CONTEXT_LENGTH_EXCEEDED: _ClassVar[ErrorCode]
    ERROR_CODE_TRANSFER_FAILED: _ClassVar[ErrorCode]
    ERROR_CODE_WORKER_LOST: _ClassVar[ErrorCode]

class DType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DTYPE_UNSPECIFIED: _ClassVar[DType]
    DTYPE_FLOAT32: _ClassVar[DType]
    DTYPE_FLOAT16: _ClassVar[DType]
    DTYPE_BFLOAT16: _ClassVar[DType]
    DTYPE_FLOAT8_E4M3FN: _ClassVar[DType]
    DTYPE_FLOAT8_E5M2: _ClassVar[DType]
    DTYPE_INT8: _ClassVar[DType]
    DTYPE_UINT8: _ClassVar[DType]
    DTYPE_INT32: _ClassVar[DType]
    DTYPE_INT64: _ClassVar[DType]

class TransportKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TRANSPORT_KIND_UNSPECIFIED: _ClassVar[TransportKind]
    TRANSPORT_KIND_TCP: _ClassVar[TransportKind]
    TRANSPORT_KIND_CUDA_IPC: _ClassVar[TransportKind]
    TRANSPORT_KIND_NCCL: _ClassVar[TransportKind]
REASONING_MODE_UNSPECIFIED: ReasoningMode
REASONING_MODE_SEPARATE: ReasoningMode
REASONING_MODE_HIDDEN: ReasoningMode
REASONING_MODE_INLINE: ReasoningMode
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_ABORT: FinishReason
FINISH_REASON_ERROR: FinishReason
FINISH_REASON_TIMEOUT: FinishReason
ERROR_CODE_UNSPECIFIED: ErrorCode
ERROR_CODE_INVALID_ARGUMENT: ErrorCode
ERROR_CODE_RESOURCE_EXHAUSTED: ErrorCode
ERROR_CODE_NOT_FOUND: ErrorCode
ERROR_CODE_FAILED_PRECONDITION: ErrorCode
ERROR_CODE_DEADLINE_EXCEEDED: ErrorCode
ERROR_CODE_UNAVAILABLE: ErrorCode
ERROR_CODE_CANCELLED: ErrorCode
ERROR_CODE_INTERNAL: ErrorCode
ERROR_CODE_UNIMPLEMENTED: ErrorCode
ERROR_CODE_CONTEXT_LENGTH_EXCEEDED: ErrorCode
ERROR_CODE_TRANSFER_FAILED: ErrorCode
ERROR_CODE_WORKER_LOST: ErrorCode
DTYPE_UNSPECIFIED: DType
DTYPE_FLOAT32: DType
DTYPE_FLOAT16: DType
DTYPE_BFLOAT16: DType
DTYPE_FLOAT8_E4M3FN: DType
DTYPE_FLOAT8_E5M2: DType
DTYPE_INT8: DType
DTYPE_UINT8: DType
DTYPE_INT32: DType
DTYPE_INT64: DType
TRANSPORT_KIND_UNSPECIFIED: TransportKind
TRANSPORT_KIND_TCP: TransportKind
TRANSPORT_KIND_CUDA_IPC: TransportKind
TRANSPORT_KIND_NCCL: TransportKind

class SamplingParams(_message.Message):
    __slots__ = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids", "n", "logprobs", "repetition_penalty", "frequency_penalty", "presence_penalty", "ignore_eos", "skip_special_tokens", "min_tokens", "prompt_logprobs", "logit_bias", "structured_output", "cache_salt", "priority", "include_stop_str_in_output")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    SKIP_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    STRUCTURED_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_STOP_STR_IN_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    seed: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    n: int
    logprobs: int
    repetition_penalty: float
    frequency_penalty: float
    presence_penalty: float
    ignore_eos: bool
    skip_special_tokens: bool
    min_tokens: int
    prompt_logprobs: int
    logit_bias: _containers.ScalarMap[int, float]
    structured_output: StructuredOutput
    cache_salt: str
    priority: int
    include_stop_str_in_output: bool
    def __init__(self, max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., min_p: _Optional[float] = ..., seed: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., n: _Optional[int] = ..., logprobs: _Optional[int] = ..., repetition_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., ignore_eos: _Optional[bool] = ..., skip_special_tokens: _Optional[bool] = ..., min_tokens: _Optional[int] = ..., prompt_logprobs: _Optional[int] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., structured_output: _Optional[_Union[StructuredOutput, _Mapping]] = ..., cache_salt: _Optional[str] = ..., priority: _Optional[int] = ..., include_stop_str_in_output: _Optional[bool] = ...) -> None: ...

class StructuredOutput(_message.Message):
    __slots__ = ("json_schema", "json_object", "regex", "choice", "grammar")
    JSON_SCHEMA_FIELD_NUMBER: _ClassVar[int]
    JSON_OBJECT_FIELD_NUMBER: _ClassVar[int]
    REGEX_FIELD_NUMBER: _ClassVar[int]
    CHOICE_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    json_schema: str
    json_object: bool
    regex: str
    choice: StringChoices
    grammar: str
    def __init__(self, json_schema: _Optional[str] = ..., json_object: _Optional[bool] = ..., regex: _Optional[str] = ..., choice: _Optional[_Union[StringChoices, _Mapping]] = ..., grammar: _Optional[str] = ...) -> None: ...

class StringChoices(_message.Message):
    __slots__ = ("choices",)
    CHOICES_FIELD_NUMBER: _ClassVar[int]
    choices: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, choices: _Optional[_Iterable[str]] = ...) -> None: ...

class ReasoningOptions(_message.Message):
    __slots__ = ("mode", "max_thinking_tokens", "min_thinking_tokens", "enable_thinking", "reasoning_effort")
    MODE_FIELD_NUMBER: _ClassVar[int]
    MAX_THINKING_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MIN_THINKING_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ENABLE_THINKING_FIELD_NUMBER: _ClassVar[int]
    REASONING_EFFORT_FIELD_NUMBER: _ClassVar[int]
    mode: ReasoningMode
    max_thinking_tokens: int
    min_thinking_tokens: int
    enable_thinking: bool
    reasoning_effort: str
    def __init__(self, mode: _Optional[_Union[ReasoningMode, str]] = ..., max_thinking_tokens: _Optional[int] = ..., min_thinking_tokens: _Optional[int] = ..., enable_thinking: _Optional[bool] = ..., reasoning_effort: _Optional[str] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "reasoning_tokens", "cached_prompt_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    REASONING_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    reasoning_tokens: int
    cached_prompt_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., reasoning_tokens: _Optional[int] = ..., cached_prompt_tokens: _Optional[int] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token_id", "logprob", "text", "rank")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    text: str
    rank: int
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., text: _Optional[str] = ..., rank: _Optional[int] = ...) -> None: ...

class TopLogprobs(_message.Message):
    __slots__ = ("sampled", "top")
    SAMPLED_FIELD_NUMBER: _ClassVar[int]
    TOP_FIELD_NUMBER: _ClassVar[int]
    sampled: TokenLogprob
    top: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    def __init__(self, sampled: _Optional[_Union[TokenLogprob, _Mapping]] = ..., top: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ...) -> None: ...

class ErrorDetail(_message.Message):
    __slots__ = ("code", "message", "field", "request_id")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    FIELD_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    code: ErrorCode
    message: str
    field: str
    request_id: str
    def __init__(self, code: _Optional[_Union[ErrorCode, str]] = ..., message: _Optional[str] = ..., field: _Optional[str] = ..., request_id: _Optional[str] = ...) -> None: ...

class TensorSpec(_message.Message):
    __slots__ = ("dtype", "shape")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    dtype: DType
    shape: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, dtype: _Optional[_Union[DType, str]] = ..., shape: _Optional[_Iterable[int]] = ...) -> None: ...

class Tensor(_message.Message):
    __slots__ = ("dtype", "shape", "data")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    dtype: DType
    shape: _containers.RepeatedScalarFieldContainer[int]
    data: bytes
    def __init__(self, dtype: _Optional[_Union[DType, str]] = ..., shape: _Optional[_Iterable[int]] = ..., data: _Optional[bytes] = ...) -> None: ...

class KVLayout(_message.Message):
    __slots__ = ("model_id", "dtype", "block_size", "num_layers", "num_kv_heads", "head_dim", "hash_namespace", "kv_head_start", "total_kv_heads")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    HASH_NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    KV_HEAD_START_FIELD_NUMBER: _ClassVar[int]
    TOTAL_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    dtype: DType
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    hash_namespace: str
    kv_head_start: int
    total_kv_heads: int
    def __init__(self, model_id: _Optional[str] = ..., dtype: _Optional[_Union[DType, str]] = ..., block_size: _Optional[int] = ..., num_layers: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., hash_namespace: _Optional[str] = ..., kv_head_start: _Optional[int] = ..., total_kv_heads: _Optional[int] = ...) -> None: ...

class TransferHandle(_message.Message):
    __slots__ = ("transport", "address", "transfer_id", "block_ids", "nccl_unique_id", "cuda_ipc_handle", "device_index", "deadline", "layout", "num_cached_blocks", "worker_id", "control_address", "rank_handles")
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    NCCL_UNIQUE_ID_FIELD_NUMBER: _ClassVar[int]
    CUDA_IPC_HANDLE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_INDEX_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    CONTROL_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    RANK_HANDLES_FIELD_NUMBER: _ClassVar[int]
    transport: TransportKind
    address: str
    transfer_id: str
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    nccl_unique_id: bytes
    cuda_ipc_handle: bytes
    device_index: int
    deadline: _timestamp_pb2.Timestamp
    layout: KVLayout
    num_cached_blocks: int
    worker_id: str
    control_address: str
    rank_handles: _containers.RepeatedCompositeFieldContainer[TransferHandle]
    def __init__(self, transport: _Optional[_Union[TransportKind, str]] = ..., address: _Optional[str] = ..., transfer_id: _Optional[str] = ..., block_ids: _Optional[_Iterable[int]] = ..., nccl_unique_id: _Optional[bytes] = ..., cuda_ipc_handle: _Optional[bytes] = ..., device_index: _Optional[int] = ..., deadline: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., layout: _Optional[_Union[KVLayout, _Mapping]] = ..., num_cached_blocks: _Optional[int] = ..., worker_id: _Optional[str] = ..., control_address: _Optional[str] = ..., rank_handles: _Optional[_Iterable[_Union[TransferHandle, _Mapping]]] = ...) -> None: ...

class KVChunkHeader(_message.Message):
    __slots__ = ("transfer_id", "layer_index", "block_ids", "dtype", "shape", "byte_length", "is_last", "num_layers")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    LAYER_INDEX_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    BYTE_LENGTH_FIELD_NUMBER: _ClassVar[int]
    IS_LAST_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    layer_index: int
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    dtype: DType
    shape: _containers.RepeatedScalarFieldContainer[int]
    byte_length: int
    is_last: bool
    num_layers: int
    def __init__(self, transfer_id: _Optional[str] = ..., layer_index: _Optional[int] = ..., block_ids: _Optional[_Iterable[int]] = ..., dtype: _Optional[_Union[DType, str]] = ..., shape: _Optional[_Iterable[int]] = ..., byte_length: _Optional[int] = ..., is_last: _Optional[bool] = ..., num_layers: _Optional[int] = ...) -> None: ...

class WorkerLoad(_message.Message):
    __slots__ = ("num_running", "num_waiting", "num_free_blocks", "num_total_blocks", "num_queued_prompt_tokens", "max_num_running", "tokens_per_second", "worker_id", "num_attached_gateways")
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    NUM_FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOTAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_QUEUED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_ATTACHED_GATEWAYS_FIELD_NUMBER: _ClassVar[int]
    num_running: int
    num_waiting: int
    num_free_blocks: int
    num_total_blocks: int
    num_queued_prompt_tokens: int
    max_num_running: int
    tokens_per_second: float
    worker_id: str
    num_attached_gateways: int
    def __init__(self, num_running: _Optional[int] = ..., num_waiting: _Optional[int] = ..., num_free_blocks: _Optional[int] = ..., num_total_blocks: _Optional[int] = ..., num_queued_prompt_tokens: _Optional[int] = ..., max_num_running: _Optional[int] = ..., tokens_per_second: _Optional[float] = ..., worker_id: _Optional[str] = ..., num_attached_gateways: _Optional[int] = ...) -> None: ...

class GetLoadRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetLoadResponse(_message.Message):
    __slots__ = ("load",)
    LOAD_FIELD_NUMBER: _ClassVar[int]
    load: WorkerLoad
    def __init__(self, load: _Optional[_Union[WorkerLoad, _Mapping]] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("request_id", "sample_index")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_INDEX_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    sample_index: int
    def __init__(self, request_id: _Optional[str] = ..., sample_index: _Optional[int] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ("found",)
    FOUND_FIELD_NUMBER: _ClassVar[int]
    found: bool
    def __init__(self, found: _Optional[bool] = ...) -> None: ...
