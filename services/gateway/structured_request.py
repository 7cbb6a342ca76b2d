"""Structured outputs on the OpenAI HTTP API: what the answer must look like, read from
`response_format` (OpenAI's `json_object` and `json_schema`), vLLM's `structured_outputs`
(`json`, `regex`, `choice`, `grammar`, `json_object`) and its older `guided_json` /
`guided_regex` / `guided_choice` / `guided_grammar`, and from a `tool_choice` that forces a
call ("required", or a named function: the answer is decoded under the calls' JSON schema and
returned as `tool_calls`). One source per request; each refusal names the field.

The gateway checks the form (a schema is a JSON object whose `$ref`s are local, choices are
strings, sizes); the workers compile it for the model's vocabulary and refuse what their grammar compiler cannot
read (an unsupported schema keyword, a bad regex) as INVALID_ARGUMENT naming
`structured_output`, which the HTTP API answers naming the field the constraint came from
(`AnswerShape.field`). The gateway imports no grammar engine (it runs without torch).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from cleave.errors import InvalidArgument
from cleave.generation.structured_output import StructuredKind, StructuredOutput
from cleave.generation.tool_calls import ForcedCall, forced_call_schema
from services.gateway.openai_tools import json_type, string_field

_VLLM_KEYS = {"json": StructuredKind.JSON_SCHEMA, "regex": StructuredKind.REGEX, "choice": StructuredKind.CHOICE,
              "grammar": StructuredKind.GRAMMAR, "json_object": StructuredKind.JSON_OBJECT}
_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
# vLLM's other `structured_outputs` options: these ask for what the workers do anyway (no
# backend fallback, no free whitespace, no properties beyond a schema's), so they are taken;
# any other key (its `structural_tag` and `whitespace_pattern` included) is refused, so that a
# misspelt constraint never yields free text.
_VLLM_TAKEN = ("disable_fallback", "disable_any_whitespace", "disable_additional_properties")


@dataclass(frozen=True)
class AnswerShape:
    """A request's constraint on its answer and where it came from (None: free text).

    Attributes:
        structured_output: the constraint the workers decode under.
        field: the request field it came from, named by refusals of its syntax.
        forced_call: the tool_choice that forced calls (their answer comes back as tool_calls).
    """

    structured_output: StructuredOutput | None = None
    field: str = ""
    forced_call: ForcedCall | None = None


def answer_shape(body: dict[str, Any], tools: tuple[dict[str, Any], ...], parallel: bool,
                 chat: bool = True) -> AnswerShape:
    """The body's one constraint on the answer, checked (tools: the request's checked tools;
    a completion has none, and its `tool_choice` is not read, as its `tools` are not)."""
    forced = _forced_call(body, tools, parallel) if chat else AnswerShape()
    shapes = [shape for shape in (_response_format(body), _vllm(body), forced) if shape.structured_output is not None]
    if len(shapes) > 1:
        raise InvalidArgument(f"constrains the answer, and so does {shapes[0].field.split('.')[0]}; "
                              "give one", field=shapes[1].field.split(".")[0])
    return shapes[0] if shapes else AnswerShape()


def _response_format(body: dict[str, Any]) -> AnswerShape:
    value = body.get("response_format")
    if value is None:
        return AnswerShape()
    if not isinstance(value, dict):
        raise InvalidArgument(f"must be an object, got {json_type(value)}", field="response_format")
    kind = value.get("type")
    if kind == "text":
        return AnswerShape()
    if kind == "json_object":
        return AnswerShape(StructuredOutput(StructuredKind.JSON_OBJECT), "response_format")
    if kind != "json_schema":
        raise InvalidArgument(f"type must be \"text\", \"json_object\" or \"json_schema\", got {kind!r}",
                              field="response_format.type")
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
        raise InvalidArgument(f"must be an object, got {json_type(spec)}", field="response_format.json_schema")
    string_field(spec.get("name"), "response_format.json_schema.name")
    schema = spec.get("schema")
    if schema is None:  # OpenAI: no schema, any JSON object
        return AnswerShape(StructuredOutput(StructuredKind.JSON_OBJECT), "response_format")
    if not isinstance(schema, dict):
        raise InvalidArgument(f"must be a JSON schema object, got {json_type(schema)}",
                              field="response_format.json_schema.schema")
    return _checked(StructuredOutput.json_schema(schema), "response_format.json_schema.schema")


def _vllm(body: dict[str, Any]) -> AnswerShape:
    """vLLM's `structured_outputs` object, or one of its `guided_*` fields."""
    given = [(name, {key: body[name]}) for name, key in _GUIDED.items() if body.get(name) not in (None, "", [])]
    options = body.get("structured_outputs")
    if options is not None:
        if not isinstance(options, dict):
            raise InvalidArgument(f"must be an object, got {json_type(options)}", field="structured_outputs")
        unknown = sorted(key for key in options if key not in _VLLM_KEYS and key not in _VLLM_TAKEN
                         and options[key] is not None)
        if unknown:
            raise InvalidArgument(f"is not supported (the forms are {', '.join(_VLLM_KEYS)})",
                                  field=f"structured_outputs.{unknown[0]}")
        given.append(("structured_outputs", options))
    forms = [(name, key, value) for name, options in given for key, value in options.items()
             if key in _VLLM_KEYS and value not in (None, False, "", [])]
    if not forms:
        return AnswerShape()
    if len(forms) > 1:
        raise InvalidArgument("set one of json, regex, choice, grammar or json_object", field=forms[1][0])
    name, key, value = forms[0]
    field = name if name.startswith("guided_") else f"{name}.{key}"
    kind = _VLLM_KEYS[key]
    if kind is StructuredKind.JSON_OBJECT:
        return AnswerShape(StructuredOutput(kind), field)
    if kind is StructuredKind.JSON_SCHEMA:
        if not isinstance(value, (dict, str)):
            raise InvalidArgument(f"must be a JSON schema (object or JSON text), got {json_type(value)}", field=field)
        return _checked(StructuredOutput.json_schema(value), field)
    if kind is StructuredKind.CHOICE:
        if not isinstance(value, list) or not all(isinstance(choice, str) for choice in value):
            raise InvalidArgument("must be a list of strings", field=field)
        return _checked(StructuredOutput(kind, choices=tuple(value)), field)
    return _checked(StructuredOutput(kind, string_field(value, field)), field)


def _forced_call(body: dict[str, Any], tools: tuple[dict[str, Any], ...], parallel: bool) -> AnswerShape:
    """tool_choice "required" or {"type": "function", "function": {"name": ...}}."""
    choice = body.get("tool_choice")
    if choice == "required":
        forced = ForcedCall()
    elif isinstance(choice, dict):
        if choice.get("type") != "function":
            raise InvalidArgument(f"type must be \"function\", got {choice.get('type')!r}", field="tool_choice.type")
        function = choice.get("function")
        if not isinstance(function, dict):
            raise InvalidArgument(f"must be an object, got {json_type(function)}", field="tool_choice.function")
        forced = ForcedCall(string_field(function.get("name"), "tool_choice.function.name"))
    else:
        return AnswerShape()
    spec = forced_call_output(forced, tools, parallel, "tool_choice", "tool_choice.function.name")
    return AnswerShape(spec, "tool_choice", forced)


def forced_call_output(forced: ForcedCall, tools: tuple[dict[str, Any], ...], parallel: bool, field: str,
                       name_field: str) -> StructuredOutput:
    """The constraint a forced tool choice decodes under (the calls' JSON schema), checked: a
    named function is among the tools (else a refusal naming `name_field`), and there are
    tools (`field`). Both front doors build it here."""
    if forced.name is not None and forced.name not in {tool["function"]["name"] for tool in tools}:
        raise InvalidArgument(f"names {forced.name!r}, which is not among the tools", field=name_field)
    if not tools:
        raise InvalidArgument("forces a tool call and needs tools to call; give tools", field=field)
    spec = StructuredOutput.json_schema(forced_call_schema(forced, tools, parallel))
    spec.validate(field)
    return spec


def _checked(spec: StructuredOutput, field: str) -> AnswerShape:
    spec.validate(field)
    return AnswerShape(spec, field)
