"""OpenAI-style JSON requests -> `GenerateSpec`, with OpenAI-style errors.

Sampling options are read from the JSON body into a `SamplingRequest` (types checked here,
as the protobuf wire types check them for gRPC) and validated by `to_sampling_params`, the
validator the gRPC API uses too, so both APIs accept and reject the same values; errors name
the OpenAI parameter (`temperature`, `max_tokens`, `messages`). Lists are counted against
their caps before their elements are read, as the gRPC API counts its repeated fields: the
prompt's (`prompt_bounds`), stop strings and ids, logit biases.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field, replace
from typing import Any

from cleave.errors import CleaveError, InvalidArgument
from cleave.generation.sampling_params import (
    MAX_LOGIT_BIAS_TOKENS,
    MAX_LOGPROBS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    PRIORITY_MAX,
    PRIORITY_MIN,
)
from cleave.generation.sampling_request import MAX_SAMPLES, SamplingRequest, to_sampling_params
from cleave.rpc.convert import at_most, checked_reasoning_effort, thinking_options
from cleave.rpc.types import ReasoningMode, ReasoningOptions
from services.gateway.backend import ChatMessage, GenerateSpec, Prompt, Scaling, StreamShape
from services.gateway.openai_fields import refuse_unsupported
from services.gateway.openai_tools import (
    assistant_tool_calls,
    json_type,
    parallel_tool_calls,
    parses_tool_calls,
    request_tools,
    tool_call_id,
)
from services.gateway.prompt_bounds import token_ids_to_read, within_context
from services.gateway.prompt_truncation import PromptTruncation
from services.gateway.request_names import chat_role
from services.gateway.structured_request import answer_shape

_HTTP_STATUS = {
    "INVALID_ARGUMENT": 400,
    "UNAUTHENTICATED": 401,
    "NOT_FOUND": 404,
    "FAILED_PRECONDITION": 400,
    "RESOURCE_EXHAUSTED": 429,
    "DEADLINE_EXCEEDED": 504,
    "UNAVAILABLE": 503,
    "CANCELLED": 499,
}
_ERROR_TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "not_found_error",
                408: "invalid_request_error", 413: "invalid_request_error", 415: "invalid_request_error",
                429: "rate_limit_error"}
MAX_UINT32 = 2**32 - 1  # the widths the gRPC API's wire types give each option
MAX_UINT64 = 2**64 - 1
_REASONING_MODES = {"separate": ReasoningMode.SEPARATE, "hidden": ReasoningMode.HIDDEN, "inline": ReasoningMode.INLINE}
_TEMPLATE_KWARGS = ("enable_thinking", "reasoning_effort")  # the chat_template_kwargs the gateway passes on
DECODED_ENCODINGS = ("gzip", "deflate")  # what aiohttp always decodes (br and zstd need optional packages)
MAX_PROMPTS = 1024  # prompts in one /v1/completions request (lm-eval sends batches of them)
_CHAT_PARAMS = {"input": "messages", "chat.messages": "messages", "sampling.logprobs": "top_logprobs"}
_COMPLETION_PARAMS = {"input": "prompt", "text": "prompt", "token_ids.ids": "prompt"}
_PATH_HEAD = re.compile(r"[.\[]")  # where a field path's first name ends


class BodyError(CleaveError):
    """An HTTP body the gateway could not take whole, answered with `http_status`."""

    http_status = 400


class BodyTooLarge(BodyError):
    """An HTTP body over the gateway's `--max-request-bytes` (HTTP 413; gRPC's own limit
    answers RESOURCE_EXHAUSTED)."""

    status_code = "RESOURCE_EXHAUSTED"
    http_status = 413


class BodyTimedOut(BodyError):
    """An HTTP body that did not arrive whole in time (HTTP 408; the connection closes, as
    the rest of the body was never read)."""

    status_code = "DEADLINE_EXCEEDED"
    http_status = 408


class BodyEncodingUnsupported(BodyError):
    """An HTTP body in a Content-Encoding the gateway cannot decode (HTTP 415, answered with
    the codings it can in `Accept-Encoding`)."""

    status_code = "INVALID_ARGUMENT"
    http_status = 415

    def __init__(self) -> None:
        super().__init__(f"is not supported; send the body uncompressed or encoded as "
                         f"{' or '.join(DECODED_ENCODINGS)}", field="Content-Encoding")


@dataclass(frozen=True)
class HttpError:
    """An error response: HTTP status, the OpenAI `{"error": {...}}` body and extra headers
    (`Retry-After` when the error says when to retry)."""

    status: int
    body: dict[str, Any]
    headers: dict[str, str] = field(default_factory=dict)


def retry_after_headers(retry_after_s: float | None) -> dict[str, str]:
    """`Retry-After` in whole seconds (HTTP has no finer unit), rounded up; none for None."""
    return {} if retry_after_s is None else {"Retry-After": str(max(1, math.ceil(retry_after_s)))}


def http_error(error: BaseException, param_names: dict[str, str]) -> HttpError:
    """The HTTP status and OpenAI error body for an exception."""
    if isinstance(error, CleaveError):
        status = error.http_status if isinstance(error, BodyError) else _HTTP_STATUS.get(error.status_code, 500)
        param = _param(error.field, param_names)
        code = "model_not_found" if status == 404 and error.field == "model" else None
        code = "invalid_api_key" if status == 401 else code
        message = error.message if param is None else f"{param}: {error.message}"
        body = {"message": message, "type": _ERROR_TYPES.get(status, "server_error"), "param": param, "code": code}
        headers = retry_after_headers(error.retry_after_s)
        if isinstance(error, BodyEncodingUnsupported):
            headers["Accept-Encoding"] = ", ".join(DECODED_ENCODINGS)
        return HttpError(status, {"error": body}, headers)
    body = {"message": "internal server error", "type": "server_error", "param": None, "code": None}
    return HttpError(500, {"error": body})


def _param(field: str | None, param_names: dict[str, str]) -> str | None:
    """The body's name for an error's field: as `param_names` maps the field or its gRPC request
    path without the section (`sampling.`); for a path under a field it renames, the renamed
    field (the path's positions may not be the body's: `messages[2]` of a translated body);
    else that path."""
    name = _openai_param(field)
    if field is None or name is None:
        return None
    for key in (field, name):
        if key in param_names:
            return param_names[key]
    head = _PATH_HEAD.split(name, maxsplit=1)[0]
    return param_names[head] if param_names.get(head, head) != head else name


def _openai_param(field: str | None) -> str | None:
    if not field:
        return None
    for prefix in ("sampling.", "reasoning.", "scaling."):
        if field.startswith(prefix):
            return field[len(prefix):]
    return field


def param_names(body: Any, chat: bool) -> dict[str, str]:
    """How errors raised past the parsing of a /v1/completions or /v1/chat/completions `body`
    name its fields -> the body's names: the gRPC request's (`chat.messages`, `text`), the
    engine's (`max_tokens`, which the body may have sent as `max_completion_tokens`) and the
    workers' grammar compiler's (`structured_output`: the field the constraint came from)."""
    names = dict(_CHAT_PARAMS if chat else _COMPLETION_PARAMS)
    if not isinstance(body, dict):
        return names
    if chat and body.get("max_completion_tokens") is not None:
        names["max_tokens"] = "max_completion_tokens"
    constraint = _answer_field(body, chat)
    if constraint:
        names["structured_output"] = constraint
    return names


def _answer_field(body: dict[str, Any], chat: bool) -> str | None:
    """The field of `body` its answer's constraint came from (None: none, or the body was
    refused before any worker saw it)."""
    try:
        tools = request_tools(body) if chat else ()
        return answer_shape(body, tools, parallel_tool_calls(body), chat).field
    except InvalidArgument:
        return None


def _uint(value: Any, param: str, high: int = MAX_UINT32) -> int:
    """A JSON integer in [0, high] (bools are not integers here)."""
    return _integer(value, param, 0, high)


def _integer(value: Any, param: str, low: int, high: int) -> int:
    """A JSON integer in [low, high] (bools are not integers here)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidArgument(f"must be an integer, got {json_type(value)}", field=param)
    if not low <= value <= high:
        raise InvalidArgument(f"must be in [{low}, {high}], got {value}", field=param)
    return value


def _float(value: Any, param: str) -> float:
    """A JSON number as a float (bools are not numbers here)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidArgument(f"must be a number, got {json_type(value)}", field=param)
    try:
        return float(value)
    except OverflowError:
        raise InvalidArgument("is out of range", field=param) from None


def _bool(value: Any, param: str) -> bool:
    if not isinstance(value, bool):
        raise InvalidArgument(f"must be true or false, got {value!r}", field=param)
    return value


def include_usage(body: dict[str, Any], stream: bool) -> bool:
    """`stream_options.include_usage`: whether a stream ends with a usage chunk. The options
    are an object, and only for a stream (as OpenAI and vLLM refuse them otherwise)."""
    options = body.get("stream_options")
    if options is None:
        return False
    if not isinstance(options, dict):
        raise InvalidArgument(f"must be an object, got {json_type(options)}", field="stream_options")
    if not stream:
        raise InvalidArgument("is only allowed when stream is true", field="stream_options")
    usage = options.get("include_usage")
    return False if usage is None else _bool(usage, "stream_options.include_usage")


def text_field(value: Any, field: str) -> str:
    """A string that can be sent on as UTF-8 (JSON's "\\ud800" escapes decode to lone
    surrogates, which cannot)."""
    if not isinstance(value, str):
        raise InvalidArgument(f"must be a string, got {type(value).__name__}", field=field)
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as error:
        raise InvalidArgument(
            f"is not valid Unicode text ({error.reason} at character {error.start}); "
            "send UTF-8 text without lone surrogate escapes", field=field
        ) from None
    return value


def _stop(value: Any) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        return [text_field(value, "stop")]
    if isinstance(value, list):
        at_most(value, MAX_STOP_STRINGS, "stop", "strings")  # before they are read, as the gRPC API's
        return [text_field(item, f"stop[{position}]") for position, item in enumerate(value)]
    raise InvalidArgument("must be a string or a list of strings", field="stop")


def _sampling(body: dict[str, Any], chat: bool) -> SamplingRequest:
    options: dict[str, Any] = {}
    max_tokens = body.get("max_completion_tokens") if chat else None
    max_param = "max_completion_tokens" if max_tokens is not None else "max_tokens"
    if max_tokens is None:
        max_tokens = body.get("max_tokens")
    if max_tokens is not None:
        lowest = 0 if not chat and body.get("echo") is True else 1  # echo alone: score the prompt
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < lowest:
            wanted = "a non-negative" if lowest == 0 else "a positive"
            raise InvalidArgument(f"must be {wanted} integer, got {max_tokens!r}", field=max_param)
        # max_tokens 0 still samples one token, which the response leaves out (`CompletionEcho`)
        options["max_tokens"] = max(1, _uint(max_tokens, max_param))
    for name in ("temperature", "top_p", "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty"):
        if body.get(name) is not None:
            options[name] = _float(body[name], name)
    top_k = body.get("top_k")
    if top_k is not None:
        options["top_k"] = 0 if top_k == -1 and not isinstance(top_k, bool) else _uint(top_k, "top_k")
    if body.get("seed") is not None:
        options["seed"] = _uint(body["seed"], "seed", MAX_UINT64)
    for name in ("ignore_eos", "skip_special_tokens"):
        if body.get(name) is not None:
            options[name] = _bool(body[name], name)
    if body.get("min_tokens") is not None:
        options["min_tokens"] = _uint(body["min_tokens"], "min_tokens")
    stop_ids = body.get("stop_token_ids")
    if stop_ids is not None:
        if not isinstance(stop_ids, list):
            raise InvalidArgument(f"must be a list of token ids, got {json_type(stop_ids)}", field="stop_token_ids")
        at_most(stop_ids, MAX_STOP_TOKEN_IDS, "stop_token_ids", "token ids")
        options["stop_token_ids"] = tuple(_uint(token_id, f"stop_token_ids[{position}]")
                                          for position, token_id in enumerate(stop_ids))
    if body.get("logit_bias") is not None:
        options["logit_bias"] = _logit_bias(body["logit_bias"])
    n = body.get("n")
    if n is not None:
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_SAMPLES:
            raise InvalidArgument(f"must be an integer in [1, {MAX_SAMPLES}], got {n!r}", field="n")
        options["n"] = n
    options["stop"] = tuple(_stop(body.get("stop")))
    if body.get("cache_salt") is not None:
        options["cache_salt"] = _cache_salt(body["cache_salt"])
    if body.get("priority") is not None:  # vLLM's: lower first, with --scheduling-policy priority
        options["priority"] = _integer(body["priority"], "priority", PRIORITY_MIN, PRIORITY_MAX)
    if chat:
        top = body.get("top_logprobs")
        top = 0 if top is None else _integer(top, "top_logprobs", 0, MAX_LOGPROBS)  # bounded, asked for or not
        if body.get("logprobs") is not None and _bool(body["logprobs"], "logprobs"):
            options["logprobs"] = top
    elif body.get("logprobs") is not None:
        options["logprobs"] = _uint(body["logprobs"], "logprobs")
    prompt_top = _prompt_logprobs(body)
    if prompt_top is None and not chat and body.get("echo") is True:
        prompt_top = options.get("logprobs")  # the echoed prompt's tokens get logprobs too (vLLM's default)
    if prompt_top is not None:
        options["prompt_logprobs"] = prompt_top
    return SamplingRequest(**options)


def _prompt_logprobs(body: dict[str, Any]) -> int | None:
    """vLLM's `prompt_logprobs`: score every prompt token, with this many top alternatives
    (bounded as `top_logprobs` is). vLLM returns no prompt scores in a stream, and refuses
    them there; so does the gateway, rather than drop what was asked for."""
    value = body.get("prompt_logprobs")
    if value is None:
        return None
    top = _integer(value, "prompt_logprobs", 0, MAX_LOGPROBS)
    if body.get("stream") is True:
        raise InvalidArgument("prompt logprobs are not streamed; send stream: false", field="prompt_logprobs")
    return top


def _truncation(body: dict[str, Any]) -> PromptTruncation | None:
    """vLLM's `truncate_prompt_tokens` (absent or null: the prompt runs whole, or is refused
    when it does not fit)."""
    value = body.get("truncate_prompt_tokens")
    return None if value is None else PromptTruncation.checked(value)


def _optional_bool(body: dict[str, Any], name: str) -> bool:
    """A true/false field of `body` (absent or null: false)."""
    return False if body.get(name) is None else _bool(body[name], name)


def _cache_salt(value: Any) -> str:
    """vLLM's cache_salt: a non-empty string (absent or null: the shared prefix cache)."""
    salt = text_field(value, "cache_salt")
    if not salt:
        raise InvalidArgument("must not be empty; leave it out to share the prefix cache", field="cache_salt")
    return salt


def _logit_bias(value: Any) -> tuple[tuple[int, float], ...]:
    """OpenAI's logit_bias: a JSON object from token ids (as strings) to biases."""
    if not isinstance(value, dict):
        raise InvalidArgument(f"must be an object mapping token ids to biases, got {json_type(value)}",
                              field="logit_bias")
    at_most(value, MAX_LOGIT_BIAS_TOKENS, "logit_bias", "biased tokens")
    pairs = []
    for key, bias in value.items():
        if not (isinstance(key, str) and key.isdigit() and key.isascii()):
            raise InvalidArgument(f"keys must be token ids, got {key!r}", field="logit_bias")
        if len(key.lstrip("0")) > len(str(MAX_UINT32)):  # int() refuses thousands of digits
            raise InvalidArgument(f"token id {key[:16]}... is out of range", field="logit_bias")
        pairs.append((_uint(int(key), "logit_bias"), _float(bias, f"logit_bias.{key}")))
    return tuple(pairs)


def _reasoning(body: dict[str, Any]) -> ReasoningOptions:
    mode_name = body.get("reasoning_mode")
    if mode_name is not None and (not isinstance(mode_name, str) or mode_name not in _REASONING_MODES):
        raise InvalidArgument(f"must be one of {', '.join(_REASONING_MODES)}", field="reasoning_mode")
    if body.get("include_reasoning") is not None and not _bool(body["include_reasoning"], "include_reasoning"):
        mode_name = "hidden"
    kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict):
        raise InvalidArgument("must be an object", field="chat_template_kwargs")
    unknown = sorted(set(kwargs) - set(_TEMPLATE_KWARGS))
    if unknown:
        raise InvalidArgument(f"only {', '.join(_TEMPLATE_KWARGS)} are passed to the chat template",
                              field=f"chat_template_kwargs.{unknown[0]}")
    enable_thinking = kwargs.get("enable_thinking")
    if enable_thinking is not None:
        enable_thinking = _bool(enable_thinking, "chat_template_kwargs.enable_thinking")
    max_thinking = body.get("max_thinking_tokens")
    if max_thinking is not None and (isinstance(max_thinking, bool) or not isinstance(max_thinking, int)
                                     or not 0 <= max_thinking <= MAX_UINT32):
        raise InvalidArgument(f"must be an integer in [0, {MAX_UINT32}], got {max_thinking!r}",
                              field="max_thinking_tokens")
    # OpenAI's field, else the template variable (vLLM passes chat_template_kwargs through)
    effort, effort_field = body.get("reasoning_effort"), "reasoning_effort"
    if effort is None:
        effort, effort_field = kwargs.get("reasoning_effort"), "chat_template_kwargs.reasoning_effort"
    return ReasoningOptions(
        mode=_REASONING_MODES.get(mode_name, ReasoningMode.DEFAULT),
        max_thinking_tokens=max_thinking,
        enable_thinking=enable_thinking,
        reasoning_effort=checked_reasoning_effort(effort, effort_field),
    )


def content_text(content: Any, field: str, part_types: tuple[str, ...] = ("text",)) -> str:
    """A message's content: a string, or a list of text parts (of `part_types`) joined."""
    if isinstance(content, str):
        return text_field(content, field)
    if isinstance(content, list):
        parts = []
        for index, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") not in part_types:
                raise InvalidArgument("only text content parts are supported", field=f"{field}[{index}]")
            parts.append(text_field(part.get("text"), f"{field}[{index}].text"))
        return "".join(parts)
    raise InvalidArgument(f"must be a string or a list of text parts, got {json_type(content)}", field=field)


def _optional_text(value: Any, field: str) -> str:
    return "" if value is None else text_field(value, field)


def chat_prompt(body: dict[str, Any], max_context_length: int = 0) -> Prompt:
    """The prompt of a chat body's `messages` and `tools`. Its turns, and the tool calls of
    those up to each, are counted against the model's context (`max_context_length`; 0:
    unknown) before they are read (`prompt_bounds`): a million empty turns held the event
    loop for seconds."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise InvalidArgument("must be a non-empty list of messages", field="messages")
    within_context(len(messages), max_context_length, "messages", "messages, each a prompt token at least")
    turns = []
    num_calls = 0
    for position, message in enumerate(messages):
        if not isinstance(message, dict):
            raise InvalidArgument(f"must be a message object, got {json_type(message)}", field=f"messages[{position}]")
        role = chat_role(message.get("role"), f"messages[{position}].role")
        calls = message.get("tool_calls") if role == "assistant" else None
        num_calls += len(calls) if isinstance(calls, list) else 0
        within_context(num_calls, max_context_length, f"messages[{position}].tool_calls",
                       "tool calls in the turns up to this one, each a prompt token at least")
        turns.append(_chat_turn(message, position, role))
    return Prompt(chat=tuple(turns), tools=request_tools(body))


def _chat_turn(message: dict[str, Any], position: int, role: str) -> ChatMessage:
    """One of a body's `messages`, its `role` already read."""
    tool_calls = assistant_tool_calls(message.get("tool_calls"), position) if role == "assistant" else ()
    content = message.get("content")
    return ChatMessage(
        role=role,
        content="" if content is None and tool_calls else content_text(content, f"messages[{position}].content"),
        reasoning_content=_optional_text(message.get("reasoning_content"), f"messages[{position}].reasoning_content"),
        name=_optional_text(message.get("name"), f"messages[{position}].name"),
        tool_calls=tool_calls,
        tool_call_id=tool_call_id(message.get("tool_call_id"), position, role),
    )


def _one_prompt(prompt: Any, field: str, max_context_length: int = 0, truncating: bool = False) -> Prompt:
    """One prompt of a completions body: text, or token ids counted before they are read
    (`prompt_bounds`: with `truncating`, the last context's worth alone are read)."""
    if isinstance(prompt, str):
        if not prompt:
            raise InvalidArgument("must not be empty", field=field)
        return Prompt(text=text_field(prompt, field), raw=True)
    if isinstance(prompt, list) and prompt:
        token_ids = token_ids_to_read(prompt, max_context_length, truncating, field)
        if all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in token_ids):
            return Prompt(token_ids=tuple(token_ids))
    raise InvalidArgument("must be a non-empty string or list of token ids", field=field)


def completion_prompts(body: dict[str, Any], max_context_length: int = 0) -> list[Prompt]:
    """The prompts of a /v1/completions body: one string or token-id list, or a list of them
    (one choice group per prompt, in order). A list is counted before its elements are read
    (prompts against MAX_PROMPTS, token ids against the model's context: `_one_prompt`)."""
    prompt = body.get("prompt")
    truncating = body.get("truncate_prompt_tokens") is not None
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):  # a batch, not token ids
        if len(prompt) > MAX_PROMPTS:
            raise InvalidArgument(f"holds {len(prompt)} prompts; at most {MAX_PROMPTS} per request", field="prompt")
        return [_one_prompt(item, f"prompt[{position}]", max_context_length, truncating)
                for position, item in enumerate(prompt)]
    if isinstance(prompt, (str, list)):
        return [_one_prompt(prompt, "prompt", max_context_length, truncating)]
    raise InvalidArgument("must be a string, a list of token ids, or a list of either", field="prompt")


def completion_prompt(body: dict[str, Any], max_context_length: int = 0) -> Prompt:
    """The one prompt of a /v1/completions body (a batch of one counts)."""
    prompts = completion_prompts(body, max_context_length)
    if len(prompts) != 1:
        raise InvalidArgument("must hold one prompt here", field="prompt")
    return prompts[0]


@dataclass(frozen=True)
class CompletionEcho:
    """`echo` of a /v1/completions body: put the prompt (and with `logprobs`, its tokens'
    logprobs) before the completion; `prompt_only` (max_tokens 0) leaves the sampled token
    out, scoring the prompt alone."""

    echo: bool = False
    prompt_only: bool = False

    @classmethod
    def of(cls, body: dict[str, Any]) -> CompletionEcho:
        echo = body.get("echo")
        if echo is not None and not isinstance(echo, bool):
            raise InvalidArgument(f"must be true or false, got {echo!r}", field="echo")
        return cls(echo=bool(echo), prompt_only=bool(echo) and body.get("max_tokens") == 0)


def generate_spec(body: Any, request_id: str, model: str, chat: bool, prompt: Prompt | None = None,
                  max_context_length: int = 0) -> tuple[GenerateSpec, bool]:
    """(validated spec, whether to stream) of a /v1/completions or /v1/chat/completions body;
    `prompt` overrides the body's (one prompt of a completions batch). The body's prompt is
    counted against `max_context_length`, the model's (0: unknown), before it is read."""
    if not isinstance(body, dict):
        raise InvalidArgument("the request body must be a JSON object", field="body")
    refuse_unsupported(body, "chat" if chat else "completions")
    if prompt is None:
        prompt = chat_prompt(body, max_context_length) if chat else completion_prompt(body, max_context_length)
    reasoning = _reasoning(body)
    if not chat and reasoning.mode is ReasoningMode.DEFAULT:
        # a raw completion is the model's text whole, thinking included (as vLLM returns it)
        reasoning = replace(reasoning, mode=ReasoningMode.INLINE)
    sampling = to_sampling_params(_sampling(body, chat), **thinking_options(reasoning))
    stream = False if body.get("stream") is None else body["stream"]
    if not isinstance(stream, bool):
        raise InvalidArgument(f"must be true or false, got {stream!r}", field="stream")
    include_usage(body, stream)
    if body.get("user") is not None:  # OpenAI's end-user id: taken, not used
        text_field(body["user"], "user")
    parallel = parallel_tool_calls(body)
    shape = answer_shape(body, prompt.tools, parallel, chat)
    sampling.structured_output = shape.structured_output
    spec = GenerateSpec(
        request_id=request_id,
        model=model,
        prompt=prompt,
        sampling=sampling,
        reasoning=reasoning,
        scaling=Scaling(num_samples=sampling.n),
        stream=StreamShape(include_token_ids=True, include_prompt_token_ids=_optional_bool(body, "return_token_ids")),
        parse_tool_calls=chat and parses_tool_calls(body, prompt.tools),
        parallel_tool_calls=parallel,
        forced_call=shape.forced_call,
        include_stop_str=_optional_bool(body, "include_stop_str_in_output"),
        truncation=_truncation(body),
    )
    return spec, stream
