"""OpenAI's Responses API (`POST /v1/responses`), as vLLM serves it for gpt-oss, on the chat
path: a request becomes a chat-completions body (`responses_body`) and is validated and run
exactly as one; the samples' thinking, answer and calls become the response's output items
(`ResponseShaper`): a `reasoning` item, a `message` item with its `output_text`, and one
`function_call` item per call, whole or as the API's server-sent events.

Input: a string (one user turn) or items: messages (`role`, text `content` or text parts),
`function_call` items (an assistant turn's calls, consecutive ones together) and
`function_call_output` items (tool turns); a `reasoning` item's text goes with the next
assistant turn; `instructions` is a system turn before them. Tools are function tools
(`{"type": "function", "name", "parameters"}`). Responses are not stored: `store` changes
nothing, and `previous_response_id`, `conversation` and `background` are a 400 naming the
field, as are `truncation: "auto"` and an `include` of what a response here never holds
(`message.output_text.logprobs`), refused as the chat API's fields are (`openai_fields`),
and every malformed item (`input[3].call_id`). `text.format` (JSON mode, a JSON schema) and
`tool_choice` "required" or a named function decode the answer under their constraint, as
on the chat route.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from cleave.errors import InvalidArgument
from cleave.generation.tool_calls import ToolCall
from cleave.rpc.types import Usage
from services.gateway.backend import GenerateChunk, GenerateSpec, SampleOutput
from services.gateway.openai_fields import refuse_unsupported
from services.gateway.openai_request import content_text, text_field
from services.gateway.openai_request import param_names as chat_param_names
from services.gateway.openai_tools import json_object, json_type, new_call_id, string_field
from services.gateway.prompt_bounds import within_context
from services.gateway.request_names import chat_role

# chat-completions names of the fields a translated request may be refused for -> the Responses API's
_PARAM_NAMES = {
    "response_format": "text.format",
    "response_format.type": "text.format.type",
    "response_format.json_schema": "text.format",
    "response_format.json_schema.name": "text.format.name",
    "response_format.json_schema.schema": "text.format.schema",
    "tool_choice.function.name": "tool_choice.name",
    "max_completion_tokens": "max_output_tokens",
    "reasoning_effort": "reasoning.effort",
    "messages": "input",
    "input": "input",
}
_PASSED_ON = ("model", "temperature", "top_p", "parallel_tool_calls", "stream", "seed", "top_logprobs", "user",
              "cache_salt", "priority")
_TEXT_PARTS = ("input_text", "output_text", "text")


def param_names(body: Any) -> dict[str, str]:
    """How errors name the fields of a Responses `body` -> its own names: the chat body it runs
    as names them as a chat request's (`openai_request.param_names`), in chat-completions
    names, which map on to the Responses API's."""
    try:  # the fields whose names depend on the body; not the input, which may be long
        chat = _chat_fields(body)
    except InvalidArgument:  # refused while translated: such errors name the Responses fields
        chat = None
    names = {field: _PARAM_NAMES.get(name, name) for field, name in chat_param_names(chat, chat=True).items()}
    return {**_PARAM_NAMES, **names}


def _messages(body: dict[str, Any], max_context_length: int = 0) -> list[dict[str, Any]]:
    """The request's `instructions` and `input` as chat messages. The input's items are
    counted against the model's context (`max_context_length`; 0: unknown) before they are
    read (`prompt_bounds`)."""
    messages: list[dict[str, Any]] = []
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise InvalidArgument(f"must be a string, got {json_type(instructions)}", field="instructions")
        messages.append({"role": "system", "content": text_field(instructions, "instructions")})
    items = body.get("input")
    if isinstance(items, str):
        return messages + [{"role": "user", "content": text_field(items, "input")}]
    if not isinstance(items, list) or not items:
        raise InvalidArgument("must be a string or a non-empty list of items", field="input")
    within_context(len(items), max_context_length, "input", "items (turns, tool calls and their reasoning)")
    reasoning = ""  # a reasoning item's text, for the assistant turn after it
    for position, item in enumerate(items):
        where = f"input[{position}]"
        if not isinstance(item, dict):
            raise InvalidArgument(f"must be an item object, got {json_type(item)}", field=where)
        kind = item.get("type", "message")
        if kind == "message":
            role = chat_role(item.get("role"), f"{where}.role")
            if role == "tool":
                raise InvalidArgument("a tool's answer is a function_call_output item", field=f"{where}.role")
            message: dict[str, Any] = {"role": role,
                                       "content": content_text(item.get("content"), f"{where}.content", _TEXT_PARTS)}
            if role == "assistant" and reasoning:
                message["reasoning_content"], reasoning = reasoning, ""
            messages.append(message)
        elif kind == "function_call":
            arguments = string_field(item.get("arguments"), f"{where}.arguments")
            json_object(arguments, f"{where}.arguments")
            call = {"id": string_field(item.get("call_id"), f"{where}.call_id"), "type": "function",
                    "function": {"name": string_field(item.get("name"), f"{where}.name"), "arguments": arguments}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                last["tool_calls"].append(call)  # the same turn's next call
            else:
                turn: dict[str, Any] = {"role": "assistant", "content": None, "tool_calls": [call]}
                if reasoning:
                    turn["reasoning_content"], reasoning = reasoning, ""
                messages.append(turn)
        elif kind == "function_call_output":
            messages.append({"role": "tool", "tool_call_id": string_field(item.get("call_id"), f"{where}.call_id"),
                             "content": content_text(item.get("output"), f"{where}.output", _TEXT_PARTS)})
        elif kind == "reasoning":
            parts = item.get("content") or []
            reasoning = content_text(parts, f"{where}.content", _TEXT_PARTS) if parts else ""
        else:
            raise InvalidArgument(f"unknown item type {kind!r}; use message, function_call, function_call_output "
                                  "or reasoning", field=f"{where}.type")
    return messages


def _tools(value: Any) -> list[dict[str, Any]] | None:
    """Function tools in the chat-completions form (`{"type", "function": {...}}`)."""
    if value is None or value == []:
        return None
    if not isinstance(value, list):
        raise InvalidArgument(f"must be a list of tools, got {json_type(value)}", field="tools")
    tools = []
    for position, tool in enumerate(value):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else json_type(tool)
            raise InvalidArgument(f"only function tools are supported, got {kind!r}", field=f"tools[{position}].type")
        function = {"name": string_field(tool.get("name"), f"tools[{position}].name")}
        for key, kind in (("description", str), ("parameters", dict), ("strict", bool)):
            if tool.get(key) is not None:
                if not isinstance(tool[key], kind):
                    raise InvalidArgument(f"must be a {kind.__name__}, got {json_type(tool[key])}",
                                          field=f"tools[{position}].{key}")
                function[key] = tool[key]
        tools.append({"type": "function", "function": function})
    return tools


def responses_body(body: Any, max_context_length: int = 0) -> dict[str, Any]:
    """The chat-completions body a Responses API request runs as (see the module docstring),
    its input counted against `max_context_length`, the model's context (0: unknown), before
    it is read. Raises InvalidArgument naming the Responses field."""
    if not isinstance(body, dict):
        raise InvalidArgument("the request body must be a JSON object", field="body")
    refuse_unsupported(body, "responses")
    return {"messages": _messages(body, max_context_length), **_chat_fields(body)}


def _chat_fields(body: Any) -> dict[str, Any]:
    """The chat-completions fields of a Responses body but its messages."""
    if not isinstance(body, dict):
        raise InvalidArgument("the request body must be a JSON object", field="body")
    chat: dict[str, Any] = {}
    response_format = _response_format(body.get("text"))
    if response_format is not None:
        chat["response_format"] = response_format
    chat.update((name, body[name]) for name in _PASSED_ON if name in body)
    tools = _tools(body.get("tools"))
    if tools is not None:
        chat["tools"] = tools
    choice = body.get("tool_choice")
    if isinstance(choice, dict) and choice.get("type") == "function":  # Responses names it flat
        choice = {"type": "function", "function": {"name": choice.get("name")}}
    if choice is not None:
        chat["tool_choice"] = choice
    if body.get("max_output_tokens") is not None:
        chat["max_completion_tokens"] = body["max_output_tokens"]
    reasoning = body.get("reasoning")
    if reasoning is not None:
        if not isinstance(reasoning, dict):
            raise InvalidArgument(f"must be an object, got {json_type(reasoning)}", field="reasoning")
        if reasoning.get("effort") is not None:
            chat["reasoning_effort"] = reasoning["effort"]
    return chat


def _response_format(text: Any) -> dict[str, Any] | None:
    """`text.format` (flat: {"type": "json_schema", "name", "schema", "strict"}) as the chat
    API's `response_format` (the schema nested under `json_schema`)."""
    if text is None:
        return None
    if not isinstance(text, dict):
        raise InvalidArgument(f"must be an object, got {json_type(text)}", field="text")
    text_format = text.get("format")
    if text_format is None:
        return None
    if not isinstance(text_format, dict):
        raise InvalidArgument(f"must be an object, got {json_type(text_format)}", field="text.format")
    if text_format.get("type") != "json_schema":
        return text_format
    schema = {key: text_format[key] for key in ("name", "schema", "strict") if key in text_format}
    return {"type": "json_schema", "json_schema": schema}


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


@dataclass
class _Item:
    """One output item being built: `reasoning`, `message` or `function_call`."""

    kind: str
    id: str
    text: list[str] = field(default_factory=list)
    call: ToolCall | None = None
    call_id: str = ""

    def json(self, status: str) -> dict[str, Any]:
        text = "".join(self.text)
        if self.kind == "reasoning":
            return {"type": "reasoning", "id": self.id, "summary": [], "status": status,
                    "content": [{"type": "reasoning_text", "text": text}] if status == "completed" else []}
        if self.kind == "message":
            return {"type": "message", "id": self.id, "role": "assistant", "status": status,
                    "content": [_output_text(text)] if status == "completed" else []}
        assert self.call is not None
        return {"type": "function_call", "id": self.id, "call_id": self.call_id, "name": self.call.name,
                "arguments": self.call.arguments if status == "completed" else "", "status": status}


def _output_text(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


class ResponseShaper:
    """Builds a response (whole, or as events) from the chunks of one sample (n = 1)."""

    def __init__(self, spec: GenerateSpec, request: dict[str, Any]) -> None:
        self.spec = spec
        self.request = request
        self.id = _new_id("resp")
        self.created_at = int(time.time())
        self.items: list[_Item] = []
        self.open: _Item | None = None  # the item text is streaming into
        self.finish_reason: str | None = None
        self.usage = Usage()
        self._sequence = 0

    # ---- whole -----------------------------------------------------------------------------

    def add(self, chunk: GenerateChunk) -> None:
        """Take a chunk in (no events)."""
        self._take(chunk, [])

    def response(self, status: str | None = None) -> dict[str, Any]:
        """The response object; the items closed so far, `status` (default: from the finish)."""
        if status is None:
            status = "incomplete" if self.finish_reason == "length" else "completed"
        done = status != "in_progress"
        request = self.request
        usage = self.usage
        return {
            "id": self.id, "object": "response", "created_at": self.created_at, "status": status,
            "model": self.spec.model, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": request.get("instructions"),
            "output": [item.json("completed") for item in self.items] if done else [],
            "parallel_tool_calls": request.get("parallel_tool_calls", True) is not False,
            "tool_choice": request.get("tool_choice", "auto"), "tools": request.get("tools") or [],
            "temperature": request.get("temperature"), "top_p": request.get("top_p"),
            "max_output_tokens": request.get("max_output_tokens"), "previous_response_id": None,
            "reasoning": {"effort": self.spec.reasoning.reasoning_effort, "summary": None},
            "text": {"format": (request.get("text") or {}).get("format") or {"type": "text"}},
            "store": False, "truncation": "disabled", "metadata": {},
            "usage": {
                "input_tokens": usage.prompt_tokens, "output_tokens": usage.completion_tokens,
                "total_tokens": usage.prompt_tokens + usage.completion_tokens,
                "input_tokens_details": {"cached_tokens": usage.cached_prompt_tokens},
                "output_tokens_details": {"reasoning_tokens": usage.reasoning_tokens},
            } if done else None,
        }

    # ---- streamed --------------------------------------------------------------------------

    def start_events(self) -> bytes:
        """`response.created` and `response.in_progress`."""
        events: list[dict[str, Any]] = []
        for kind in ("response.created", "response.in_progress"):
            self._event(events, kind, response=self.response("in_progress"))
        return _sse(events)

    def events(self, chunk: GenerateChunk) -> bytes:
        """The events a chunk makes: items opened, text deltas, items closed."""
        events: list[dict[str, Any]] = []
        self._take(chunk, events)
        return _sse(events)

    def end_events(self) -> bytes:
        """The open item closed, then `response.completed` (or `response.incomplete`)."""
        events: list[dict[str, Any]] = []
        self._close(events)
        status = "incomplete" if self.finish_reason == "length" else "completed"
        self._event(events, f"response.{status}", response=self.response(status))
        return _sse(events)

    def error_event(self, body: dict[str, Any]) -> bytes:
        error = body.get("error", {})
        events: list[dict[str, Any]] = []
        self._event(events, "error", code=error.get("code"), message=error.get("message", ""), param=error.get("param"))
        return _sse(events)

    # ---- internals -------------------------------------------------------------------------

    def _take(self, chunk: GenerateChunk, events: list[dict[str, Any]]) -> None:
        if chunk.usage is not None:
            self.usage = chunk.usage
        for sample in chunk.samples:
            self._sample(sample, events)

    def _sample(self, sample: SampleOutput, events: list[dict[str, Any]]) -> None:
        if sample.reasoning_text:
            self._append("reasoning", sample.reasoning_text, events)
        if sample.text:
            self._append("message", sample.text, events)
        for call in sample.tool_calls:
            self._close(events)
            item = _Item("function_call", _new_id("fc"), call=call, call_id=new_call_id())
            self.items.append(item)
            index = len(self.items) - 1
            self._event(events, "response.output_item.added", output_index=index, item=item.json("in_progress"))
            self._event(events, "response.function_call_arguments.delta", item_id=item.id, output_index=index,
                        delta=call.arguments)
            self._event(events, "response.function_call_arguments.done", item_id=item.id, output_index=index,
                        arguments=call.arguments)
            self._event(events, "response.output_item.done", output_index=index, item=item.json("completed"))
        if sample.finish_reason is not None:
            self.finish_reason = sample.finish_reason.value

    def _append(self, kind: str, text: str, events: list[dict[str, Any]]) -> None:
        """Text into the open item of `kind`, opening one (and closing another) first."""
        if self.open is None or self.open.kind != kind:
            self._close(events)
            self.open = _Item(kind, _new_id("rs" if kind == "reasoning" else "msg"))
            self.items.append(self.open)
            index = len(self.items) - 1
            self._event(events, "response.output_item.added", output_index=index, item=self.open.json("in_progress"))
            part = {"type": "reasoning_text", "text": ""} if kind == "reasoning" else _output_text("")
            self._event(events, "response.content_part.added", item_id=self.open.id, output_index=index,
                        content_index=0, part=part)
        self.open.text.append(text)
        kind_name = "reasoning_text" if kind == "reasoning" else "output_text"
        extra = {} if kind == "reasoning" else {"logprobs": []}
        self._event(events, f"response.{kind_name}.delta", item_id=self.open.id, output_index=len(self.items) - 1,
                    content_index=0, delta=text, **extra)

    def _close(self, events: list[dict[str, Any]]) -> None:
        item, self.open = self.open, None
        if item is None:
            return
        index = self.items.index(item)
        text = "".join(item.text)
        if item.kind == "reasoning":
            part: dict[str, Any] = {"type": "reasoning_text", "text": text}
            self._event(events, "response.reasoning_text.done", item_id=item.id, output_index=index, content_index=0,
                        text=text)
        else:
            part = _output_text(text)
            self._event(events, "response.output_text.done", item_id=item.id, output_index=index, content_index=0,
                        text=text, logprobs=[])
        self._event(events, "response.content_part.done", item_id=item.id, output_index=index, content_index=0,
                    part=part)
        self._event(events, "response.output_item.done", output_index=index, item=item.json("completed"))

    def _event(self, events: list[dict[str, Any]], kind: str, **fields: Any) -> None:
        events.append({"type": kind, "sequence_number": self._sequence, **fields})
        self._sequence += 1


def _sse(events: list[dict[str, Any]]) -> bytes:
    """Server-sent events as the Responses API writes them: `event:` names the type."""
    return b"".join(f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n".encode()
                    for event in events)
