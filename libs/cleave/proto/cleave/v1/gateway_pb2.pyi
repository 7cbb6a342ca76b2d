import datetime

from cleave.proto.cleave.v1 import common_pb2 as _common_pb2
from google.protobuf import duration_pb2 as _duration_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ToolChoice(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TOOL_CHOICE_UNSPECIFIED: _ClassVar[ToolChoice]
    TOOL_CHOICE_AUTO: _ClassVar[ToolChoice]
    TOOL_CHOICE_NONE: _ClassVar[ToolChoice]
    TOOL_CHOICE_REQUIRED: _ClassVar[ToolChoice]
TOOL_CHOICE_UNSPECIFIED: ToolChoice
TOOL_CHOICE_AUTO: ToolChoice
TOOL_CHOICE_NONE: ToolChoice
TOOL_CHOICE_REQUIRED: ToolChoice

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class ChatMessage(_message.Message):
    __slots__ = ("role", "content", "reasoning_content", "name", "tool_calls", "tool_call_id")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    REASONING_CONTENT_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALL_ID_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    reasoning_content: str
    name: str
    tool_calls: _containers.RepeatedCompositeFieldContainer[ToolCall]
    tool_call_id: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ..., reasoning_content: _Optional[str] = ..., name: _Optional[str] = ..., tool_calls: _Optional[_Iterable[_Union[ToolCall, _Mapping]]] = ..., tool_call_id: _Optional[str] = ...) -> None: ...

class Tool(_message.Message):
    __slots__ = ("name", "description", "parameters_json")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    PARAMETERS_JSON_FIELD_NUMBER: _ClassVar[int]
    name: str
    description: str
    parameters_json: str
    def __init__(self, name: _Optional[str] = ..., description: _Optional[str] = ..., parameters_json: _Optional[str] = ...) -> None: ...

class ToolCall(_message.Message):
    __slots__ = ("id", "name", "arguments_json")
    ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    ARGUMENTS_JSON_FIELD_NUMBER: _ClassVar[int]
    id: str
    name: str
    arguments_json: str
    def __init__(self, id: _Optional[str] = ..., name: _Optional[str] = ..., arguments_json: _Optional[str] = ...) -> None: ...

class ChatMessages(_message.Message):
    __slots__ = ("messages",)
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    def __init__(self, messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ...) -> None: ...

class StreamOptions(_message.Message):
    __slots__ = ("aggregate", "include_token_ids", "continuous_usage")
    AGGREGATE_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    CONTINUOUS_USAGE_FIELD_NUMBER: _ClassVar[int]
    aggregate: bool
    include_token_ids: bool
    continuous_usage: bool
    def __init__(self, aggregate: _Optional[bool] = ..., include_token_ids: _Optional[bool] = ..., continuous_usage: _Optional[bool] = ...) -> None: ...

class CodeTest(_message.Message):
    __slots__ = ("stdin", "expected_stdout")
    STDIN_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_STDOUT_FIELD_NUMBER: _ClassVar[int]
    stdin: str
    expected_stdout: str
    def __init__(self, stdin: _Optional[str] = ..., expected_stdout: _Optional[str] = ...) -> None: ...

class Verifier(_message.Message):
    __slots__ = ("kind", "expected_answer", "tests", "timeout")
    class Kind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        KIND_UNSPECIFIED: _ClassVar[Verifier.Kind]
        KIND_MATH: _ClassVar[Verifier.Kind]
        KIND_CODE: _ClassVar[Verifier.Kind]
    KIND_UNSPECIFIED: Verifier.Kind
    KIND_MATH: Verifier.Kind
    KIND_CODE: Verifier.Kind
    KIND_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_ANSWER_FIELD_NUMBER: _ClassVar[int]
    TESTS_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_FIELD_NUMBER: _ClassVar[int]
    kind: Verifier.Kind
    expected_answer: str
    tests: _containers.RepeatedCompositeFieldContainer[CodeTest]
    timeout: _duration_pb2.Duration
    def __init__(self, kind: _Optional[_Union[Verifier.Kind, str]] = ..., expected_answer: _Optional[str] = ..., tests: _Optional[_Iterable[_Union[CodeTest, _Mapping]]] = ..., timeout: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ...) -> None: ...

class TestTimeScaling(_message.Message):
    __slots__ = ("strategy", "num_samples", "verifier", "return_all_samples")
    class Strategy(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        STRATEGY_UNSPECIFIED: _ClassVar[TestTimeScaling.Strategy]
        STRATEGY_NONE: _ClassVar[TestTimeScaling.Strategy]
        STRATEGY_MAJORITY_VOTE: _ClassVar[TestTimeScaling.Strategy]
        STRATEGY_BEST_OF_N: _ClassVar[TestTimeScaling.Strategy]
        STRATEGY_GROUP_ROLLOUT: _ClassVar[TestTimeScaling.Strategy]
    STRATEGY_UNSPECIFIED: TestTimeScaling.Strategy
    STRATEGY_NONE: TestTimeScaling.Strategy
    STRATEGY_MAJORITY_VOTE: TestTimeScaling.Strategy
    STRATEGY_BEST_OF_N: TestTimeScaling.Strategy
    STRATEGY_GROUP_ROLLOUT: TestTimeScaling.Strategy
    STRATEGY_FIELD_NUMBER: _ClassVar[int]
    NUM_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    VERIFIER_FIELD_NUMBER: _ClassVar[int]
    RETURN_ALL_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    strategy: TestTimeScaling.Strategy
    num_samples: int
    verifier: Verifier
    return_all_samples: bool
    def __init__(self, strategy: _Optional[_Union[TestTimeScaling.Strategy, str]] = ..., num_samples: _Optional[int] = ..., verifier: _Optional[_Union[Verifier, _Mapping]] = ..., return_all_samples: _Optional[bool] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "model", "text", "token_ids", "chat", "sampling", "reasoning", "scaling", "raw_prompt", "stream", "tools", "tool_choice", "parallel_tool_calls", "tool_choice_function", "truncate_prompt_tokens")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    CHAT_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    REASONING_FIELD_NUMBER: _ClassVar[int]
    SCALING_FIELD_NUMBER: _ClassVar[int]
    RAW_PROMPT_FIELD_NUMBER: _ClassVar[int]
    STREAM_FIELD_NUMBER: _ClassVar[int]
    TOOLS_FIELD_NUMBER: _ClassVar[int]
    TOOL_CHOICE_FIELD_NUMBER: _ClassVar[int]
    PARALLEL_TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    TOOL_CHOICE_FUNCTION_FIELD_NUMBER: _ClassVar[int]
    TRUNCATE_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    model: str
    text: str
    token_ids: TokenIds
    chat: ChatMessages
    sampling: _common_pb2.SamplingParams
    reasoning: _common_pb2.ReasoningOptions
    scaling: TestTimeScaling
    raw_prompt: bool
    stream: StreamOptions
    tools: _containers.RepeatedCompositeFieldContainer[Tool]
    tool_choice: ToolChoice
    parallel_tool_calls: bool
    tool_choice_function: str
    truncate_prompt_tokens: int
    def __init__(self, request_id: _Optional[str] = ..., model: _Optional[str] = ..., text: _Optional[str] = ..., token_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., chat: _Optional[_Union[ChatMessages, _Mapping]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., reasoning: _Optional[_Union[_common_pb2.ReasoningOptions, _Mapping]] = ..., scaling: _Optional[_Union[TestTimeScaling, _Mapping]] = ..., raw_prompt: _Optional[bool] = ..., stream: _Optional[_Union[StreamOptions, _Mapping]] = ..., tools: _Optional[_Iterable[_Union[Tool, _Mapping]]] = ..., tool_choice: _Optional[_Union[ToolChoice, str]] = ..., parallel_tool_calls: _Optional[bool] = ..., tool_choice_function: _Optional[str] = ..., truncate_prompt_tokens: _Optional[int] = ...) -> None: ...

class SampleDelta(_message.Message):
    __slots__ = ("index", "text", "token_ids", "reasoning_text", "finish_reason", "logprobs", "reward", "advantage", "answer", "error", "tool_calls")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    REASONING_TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    REWARD_FIELD_NUMBER: _ClassVar[int]
    ADVANTAGE_FIELD_NUMBER: _ClassVar[int]
    ANSWER_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    index: int
    text: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    reasoning_text: str
    finish_reason: _common_pb2.FinishReason
    logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TopLogprobs]
    reward: float
    advantage: float
    answer: str
    error: _common_pb2.ErrorDetail
    tool_calls: _containers.RepeatedCompositeFieldContainer[ToolCall]
    def __init__(self, index: _Optional[int] = ..., text: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., reasoning_text: _Optional[str] = ..., finish_reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ..., logprobs: _Optional[_Iterable[_Union[_common_pb2.TopLogprobs, _Mapping]]] = ..., reward: _Optional[float] = ..., advantage: _Optional[float] = ..., answer: _Optional[str] = ..., error: _Optional[_Union[_common_pb2.ErrorDetail, _Mapping]] = ..., tool_calls: _Optional[_Iterable[_Union[ToolCall, _Mapping]]] = ...) -> None: ...

class AnswerVotes(_message.Message):
    __slots__ = ("answer", "num_votes", "sample_indices")
    ANSWER_FIELD_NUMBER: _ClassVar[int]
    NUM_VOTES_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_INDICES_FIELD_NUMBER: _ClassVar[int]
    answer: str
    num_votes: int
    sample_indices: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, answer: _Optional[str] = ..., num_votes: _Optional[int] = ..., sample_indices: _Optional[_Iterable[int]] = ...) -> None: ...

class VoteSummary(_message.Message):
    __slots__ = ("answers",)
    ANSWERS_FIELD_NUMBER: _ClassVar[int]
    answers: _containers.RepeatedCompositeFieldContainer[AnswerVotes]
    def __init__(self, answers: _Optional[_Iterable[_Union[AnswerVotes, _Mapping]]] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("request_id", "samples", "usage", "selected_index", "votes", "model", "prompt_logprobs", "prompt_token_ids")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    SELECTED_INDEX_FIELD_NUMBER: _ClassVar[int]
    VOTES_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    samples: _containers.RepeatedCompositeFieldContainer[SampleDelta]
    usage: _common_pb2.Usage
    selected_index: int
    votes: VoteSummary
    model: str
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TopLogprobs]
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, request_id: _Optional[str] = ..., samples: _Optional[_Iterable[_Union[SampleDelta, _Mapping]]] = ..., usage: _Optional[_Union[_common_pb2.Usage, _Mapping]] = ..., selected_index: _Optional[int] = ..., votes: _Optional[_Union[VoteSummary, _Mapping]] = ..., model: _Optional[str] = ..., prompt_logprobs: _Optional[_Iterable[_Union[_common_pb2.TopLogprobs, _Mapping]]] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class ListModelsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("id", "source", "max_context_length", "is_reasoning_model")
    ID_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_LENGTH_FIELD_NUMBER: _ClassVar[int]
    IS_REASONING_MODEL_FIELD_NUMBER: _ClassVar[int]
    id: str
    source: str
    max_context_length: int
    is_reasoning_model: bool
    def __init__(self, id: _Optional[str] = ..., source: _Optional[str] = ..., max_context_length: _Optional[int] = ..., is_reasoning_model: _Optional[bool] = ...) -> None: ...

class ListModelsResponse(_message.Message):
    __slots__ = ("models",)
    MODELS_FIELD_NUMBER: _ClassVar[int]
    models: _containers.RepeatedCompositeFieldContainer[ModelInfo]
    def __init__(self, models: _Optional[_Iterable[_Union[ModelInfo, _Mapping]]] = ...) -> None: ...
