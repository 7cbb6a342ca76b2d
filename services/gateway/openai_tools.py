"""OpenAI's tool calling on /v1/chat/completions: the request's `tools`, `tool_choice`,
`parallel_tool_calls` and tool turns checked (a 400 naming the field), and calls shaped as
OpenAI returns them.

`tools` go to the chat template, which describes them to the model; with `tool_choice`
"auto" (the default) the answer's calls come back in `message.tool_calls` (streamed: one
`delta.tool_calls` entry per call, whole) and the choice finishes with "tool_calls".
"none" renders the tools but leaves the answer as text, as vLLM does. "required" and a named
function decode the answer under the calls' JSON schema (`structured_request`), as vLLM does.
`parallel_tool_calls: false` keeps an answer's first call only. An assistant turn's calls are
handed to the template with their arguments as objects (what templates iterate over), a tool
turn with the id of the call it answers.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from cleave.errors import InvalidArgument
from cleave.generation.tool_calls import ToolCall

MAX_TOOLS = 128  # OpenAI's limit per request


def json_type(value: Any) -> str:
    """A JSON value's type as an error message names it."""
    return "null" if value is None else type(value).__name__


def string_field(value: Any, field: str, required: bool = True) -> str:
    """A non-empty string (or, not `required`, a string or null: "")."""
    if value is None and not required:
        return ""
    if not isinstance(value, str) or (required and not value):
        raise InvalidArgument(f"must be a non-empty string, got {json_type(value)}", field=field)
    return value


def _object(value: Any, field: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise InvalidArgument(f"must be an object, got {json_type(value)}", field=field)
    return value


def _function_type(value: Any, field: str) -> None:
    if value != "function":
        raise InvalidArgument(f"must be \"function\", got {value!r}", field=field)


def request_tools(body: dict[str, Any]) -> tuple[dict[str, Any], ...]:
    """The request's `tools`, checked: [{"type": "function", "function": {"name", "description"?,
    "parameters"? (a JSON schema object), "strict"?}}], at most MAX_TOOLS."""
    tools = body.get("tools")
    if tools is None or tools == []:
        return ()
    if not isinstance(tools, list):
        raise InvalidArgument(f"must be a list of tools, got {json_type(tools)}", field="tools")
    if len(tools) > MAX_TOOLS:
        raise InvalidArgument(f"holds {len(tools)} tools; at most {MAX_TOOLS}", field="tools")
    checked = []
    for position, tool in enumerate(tools):
        field = f"tools[{position}]"
        tool = _object(tool, field)
        _function_type(tool.get("type"), f"{field}.type")
        function = _object(tool.get("function"), f"{field}.function")
        string_field(function.get("name"), f"{field}.function.name")
        string_field(function.get("description"), f"{field}.function.description", required=False)
        if function.get("parameters") is not None:
            _object(function["parameters"], f"{field}.function.parameters")
        strict = function.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise InvalidArgument(f"must be true or false, got {strict!r}", field=f"{field}.function.strict")
        checked.append({"type": "function", "function": function})
    return tuple(checked)


def parses_tool_calls(body: dict[str, Any], tools: tuple[dict[str, Any], ...]) -> bool:
    """Whether the answer's tool calls are parsed out of its content in the model's own
    format: tools given and `tool_choice` "auto" (or unset). Raises InvalidArgument for a
    choice that is none of OpenAI's."""
    choice = body.get("tool_choice")
    if choice not in (None, "auto", "none", "required") and not isinstance(choice, dict):
        raise InvalidArgument(f"must be \"auto\", \"none\", \"required\" or a named function, got {choice!r}",
                              field="tool_choice")
    if choice == "auto" and not tools:
        raise InvalidArgument("\"auto\" needs tools to choose from; give tools", field="tool_choice")
    return bool(tools) and choice in (None, "auto")  # "required" and named: `structured_request`


def parallel_tool_calls(body: dict[str, Any]) -> bool:
    """`parallel_tool_calls` (default true): false keeps an answer's first call only."""
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise InvalidArgument(f"must be true or false, got {parallel!r}", field="parallel_tool_calls")
    return parallel is not False


def assistant_tool_calls(value: Any, position: int) -> tuple[dict[str, Any], ...]:
    """An assistant turn's `tool_calls`, checked, with each call's arguments parsed from
    JSON text into an object (as chat templates read them)."""
    field = f"messages[{position}].tool_calls"
    if value is None or value == []:
        return ()
    if not isinstance(value, list):
        raise InvalidArgument(f"must be a list of tool calls, got {json_type(value)}", field=field)
    calls = []
    for index, call in enumerate(value):
        call_field = f"{field}[{index}]"
        call = _object(call, call_field)
        _function_type(call.get("type", "function"), f"{call_field}.type")
        function = _object(call.get("function"), f"{call_field}.function")
        name = string_field(function.get("name"), f"{call_field}.function.name")
        arguments = function.get("arguments", "{}")
        arguments_field = f"{call_field}.function.arguments"
        arguments = json_object(arguments or "{}", arguments_field) if isinstance(arguments, str) else arguments
        _object(arguments, arguments_field)
        calls.append({"id": string_field(call.get("id"), f"{call_field}.id", required=False), "type": "function",
                      "function": {"name": name, "arguments": arguments}})
    return tuple(calls)


def json_object(text: str, field: str) -> dict[str, Any]:
    """JSON text of an object (call arguments, a parameters schema) as the object."""
    try:
        value = json.loads(text)
    except RecursionError:
        raise InvalidArgument("is nested too deeply to parse", field=field) from None
    except ValueError:
        raise InvalidArgument("must be JSON text of an object", field=field) from None
    return _object(value, field)


def tool_call_id(value: Any, position: int, role: str) -> str:
    """A turn's `tool_call_id`: required of tool turns (the call they answer), else absent."""
    field = f"messages[{position}].tool_call_id"
    if role == "tool":
        return string_field(value, field)
    if value is not None:
        raise InvalidArgument("only a tool message answers a tool call", field=field)
    return ""


def new_call_id() -> str:
    """A fresh id for a call the gateway returns (both front doors)."""
    return f"call_{uuid.uuid4().hex[:24]}"


def call_json(call: ToolCall) -> dict[str, Any]:
    """A call as OpenAI returns it, under a fresh id."""
    return {"id": new_call_id(), "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
