"""OpenAI request fields the gateway cannot honour: refused by name, never silently dropped.

A client that sends `modalities: ["audio"]` expects audio back; answering with text as if the
field were absent is worse than an error. So, as vLLM does for what it cannot serve, each
field below is a 400 naming it when it asks for something (a null, an empty list or the
field's no-op value such as `function_call: "none"` asks for nothing and passes). A value of
the wrong type is a 400 too, whatever it would ask for. Completions' fields sent to chat
(`best_of`, `suffix`, `echo`) and vLLM's `truncate_prompt_tokens` are read the same way.
Fields that change nothing about the output (`user`, `metadata`, `store`, `service_tier`)
are accepted. Tools (`tools`, `tool_choice`, `parallel_tool_calls`) are served:
`openai_tools`; structured outputs (`response_format`, `structured_outputs`, `guided_*`):
`structured_request`; vLLM's `prompt_logprobs`, `return_token_ids` and
`include_stop_str_in_output`: `openai_request`; the Responses API's own fields:
`responses_api`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from cleave.errors import InvalidArgument
from services.gateway.openai_tools import json_type

# what a field's value must be, by the JSON type it names in an error
_TYPES: dict[str, Callable[[Any], bool]] = {
    "an integer": lambda value: isinstance(value, int) and not isinstance(value, bool),
    "true or false": lambda value: isinstance(value, bool),
    "a string": lambda value: isinstance(value, str),
}


def _empty(value: Any, body: dict[str, Any]) -> bool:
    return value == [] or value == {} or value == ""


def _no_more_than_n(value: Any, body: dict[str, Any]) -> bool:
    """best_of at most n: n samples, all returned, as n alone asks."""
    n = body.get("n")
    return value <= (n if isinstance(n, int) and not isinstance(n, bool) and n > 1 else 1)


@dataclass(frozen=True)
class _Unhonoured:
    """A field the gateway refuses unless its value asks for nothing.

    Attributes:
        reason: why it is refused (the message tells the client what to do instead).
        kind: what its value must be (a key of `_TYPES`); "": any JSON value.
        no_op: whether a (non-null, well-typed) value asks for nothing.
        lowest: the least integer value (kind "an integer" only).
    """

    reason: str
    kind: str = ""
    no_op: Callable[[Any, dict[str, Any]], bool] = _empty
    lowest: int | None = None


def _is(expected: Any) -> Callable[[Any, dict[str, Any]], bool]:
    """No-op: `expected`, or an empty value."""
    return lambda value, body: value == expected or _empty(value, body)


def _never(value: Any, body: dict[str, Any]) -> bool:
    return False


_BEST_OF = _Unhonoured("best_of larger than n is not supported; use n, or the gRPC API's best-of-N scaling",
                       "an integer", _no_more_than_n, lowest=1)
_SUFFIX = _Unhonoured("suffix (insertion) is not supported", "a string")
# vLLM's extensions, on both routes
_EXTENSIONS = {
    "truncate_prompt_tokens": _Unhonoured("prompts are never truncated; shorten the prompt", "an integer", _never),
}
_REFUSED_CHAT = {
    "functions": _Unhonoured("the legacy functions API is not supported; use tools"),
    "function_call": _Unhonoured("the legacy functions API is not supported (only \"none\"); use tool_choice",
                                 no_op=_is("none")),
    "audio": _Unhonoured("audio output is not supported"),
    "modalities": _Unhonoured("only text output is supported ([\"text\"])", no_op=_is(["text"])),
    "prediction": _Unhonoured("predicted outputs are not supported"),
    "web_search_options": _Unhonoured("web search is not supported"),
    "best_of": _BEST_OF,
    "suffix": _SUFFIX,
    # vLLM's chat echo puts the last turn before the answer; /v1/completions' echo is served
    "echo": _Unhonoured("echo is only served by /v1/completions", "true or false", _is(False)),
    "add_special_tokens": _Unhonoured("only false is supported: the chat template places the special tokens",
                                      "true or false", _is(False)),
    **_EXTENSIONS,
}
_REFUSED_COMPLETIONS = {
    "suffix": _SUFFIX,
    "best_of": _BEST_OF,
    "add_special_tokens": _Unhonoured("only true is supported: a prompt's text is tokenized with the tokenizer's "
                                      "special tokens", "true or false", _is(True)),
    **_EXTENSIONS,
}


def refuse_unsupported(body: dict[str, Any], chat: bool) -> None:
    """Raise InvalidArgument naming the first field of `body` this gateway cannot honour, or
    one of those fields holding a value of the wrong type."""
    refused = _REFUSED_CHAT if chat else _REFUSED_COMPLETIONS
    for name, field in refused.items():
        value = body.get(name)
        if value is None:
            continue
        if field.kind and not _TYPES[field.kind](value):
            raise InvalidArgument(f"must be {field.kind}, got {json_type(value)}", field=name)
        if field.lowest is not None and value < field.lowest:
            raise InvalidArgument(f"must be an integer >= {field.lowest}, got {value}", field=name)
        if not field.no_op(value, body):
            raise InvalidArgument(field.reason, field=name)
