"""OpenAI request fields the gateway cannot honour: refused by name, never silently dropped.

A client that sends `modalities: ["audio"]` expects audio back; answering with text as if the
field were absent is worse than an error. So, as vLLM does for what it cannot serve, each
field below is a 400 naming it when it asks for something (a null, an empty list or the
field's no-op value such as `function_call: "none"` asks for nothing and passes). A value of
the wrong type is a 400 too, whatever it would ask for. Completions' fields sent to chat
(`best_of`, `suffix`, `echo`) are read the same way, and vLLM's `truncation_side`, of which
only "left" (its default) is served.
Fields that change nothing about the output (`user`, `metadata`, `store`, `service_tier`)
are accepted. The Responses API's own are refused here too: the stored state it cannot
reach (`previous_response_id`, `conversation`, `background`, `prompt`), `truncation: "auto"`
and an `include` of what a response here never holds (each item judged, the error naming
it: `include[1]`). Tools (`tools`, `tool_choice`, `parallel_tool_calls`) are served:
`openai_tools`; structured outputs (`response_format`, `structured_outputs`, `guided_*`):
`structured_request`; vLLM's `prompt_logprobs`, `return_token_ids` and
`include_stop_str_in_output`: `openai_request`; its `truncate_prompt_tokens`:
`prompt_truncation`; the rest of the Responses API: `responses_api`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, Literal

from cleave.errors import InvalidArgument
from services.gateway.openai_tools import json_type

# what a field's value must be, by the JSON type it names in an error
_TYPES: dict[str, Callable[[Any], bool]] = {
    "an integer": lambda value: isinstance(value, int) and not isinstance(value, bool),
    "true or false": lambda value: isinstance(value, bool),
    "a string": lambda value: isinstance(value, str),
    "a list of strings": lambda value: isinstance(value, list),  # the items: `item_kind`
}
Route = Literal["chat", "completions", "responses"]  # the route a body was sent to: its table of fields


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
        reason: why it is refused (the message tells the client what to do instead), or a
            function of the refused value giving it, where that depends on the value.
        kind: what its value must be (a key of `_TYPES`); "": any JSON value.
        no_op: whether a (non-null, well-typed) value asks for nothing.
        lowest: the least integer value (kind "an integer" only).
        item_kind: for a list whose items each ask for something: what an item must be;
            `no_op` and `reason` then judge each item, and an error names it (`include[1]`).
    """

    reason: str | Callable[[Any], str]
    kind: str = ""
    no_op: Callable[[Any, dict[str, Any]], bool] = _empty
    lowest: int | None = None
    item_kind: str = ""

    def refuse(self, name: str, value: Any, body: dict[str, Any]) -> None:
        """Raise InvalidArgument naming `name` if `value` (not null) is of the wrong type or
        asks for something."""
        if self.kind and not _TYPES[self.kind](value):
            raise InvalidArgument(f"must be {self.kind}, got {json_type(value)}", field=name)
        if self.item_kind:
            each = replace(self, kind=self.item_kind, item_kind="")
            for position, item in enumerate(value):
                each.refuse(f"{name}[{position}]", item, body)
            return
        if self.lowest is not None and value < self.lowest:
            raise InvalidArgument(f"must be an integer >= {self.lowest}, got {value}", field=name)
        if not self.no_op(value, body):
            raise InvalidArgument(self.reason if isinstance(self.reason, str) else self.reason(value), field=name)


def _is(expected: Any) -> Callable[[Any, dict[str, Any]], bool]:
    """No-op: `expected`, or an empty value."""
    return lambda value, body: value == expected or _empty(value, body)


def _always(value: Any, body: dict[str, Any]) -> bool:
    return True


def _among(values: tuple[Any, ...]) -> Callable[[Any, dict[str, Any]], bool]:
    """No-op: one of `values` (an empty value is not)."""
    return lambda value, body: value in values


_BEST_OF = _Unhonoured("best_of larger than n is not supported; use n, or the gRPC API's best-of-N scaling",
                       "an integer", _no_more_than_n, lowest=1)
_SUFFIX = _Unhonoured("suffix (insertion) is not supported", "a string")
# vLLM's side for truncate_prompt_tokens (`prompt_truncation`): its default for generating
# models, the left, keeps the prompt's last tokens, the only side served here
_TRUNCATION_SIDE = _Unhonoured("only \"left\" is supported: truncate_prompt_tokens keeps the prompt's last tokens",
                               "a string", _among(("left",)))
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
    "truncation_side": _TRUNCATION_SIDE,
}
_REFUSED_COMPLETIONS = {
    "suffix": _SUFFIX,
    "best_of": _BEST_OF,
    "add_special_tokens": _Unhonoured("only true is supported: a prompt's text is tokenized with the tokenizer's "
                                      "special tokens", "true or false", _is(True)),
    "truncation_side": _TRUNCATION_SIDE,
}


# `include` values that ask for nothing here: the outputs of built-in tools and images, which
# the gateway refuses in a request, and the reasoning, which a response carries in clear and
# the input takes back as it is
_INCLUDED_ANYWAY = ("web_search_call.action.sources", "code_interpreter_call.outputs",
                    "computer_call_output.output.image_url", "file_search_call.results",
                    "message.input_image.image_url", "reasoning.encrypted_content")
_NOT_INCLUDED = {"message.output_text.logprobs": "logprobs are not returned here; use /v1/chat/completions "
                                                 "with logprobs"}


def _include_reason(value: str) -> str:
    return _NOT_INCLUDED.get(value) or f"{value[:64]!r} is not an include value of the Responses API"


def _truncation_reason(value: Any) -> str:
    if value == "auto":
        return "only \"disabled\" is supported: the input is never truncated; shorten it"
    return f"must be \"auto\" or \"disabled\", got {value!r}"


_REFUSED_RESPONSES = {
    "previous_response_id": _Unhonoured("responses are not stored; send the whole conversation as input",
                                        no_op=_is(False)),
    "conversation": _Unhonoured("conversations are not stored; send the whole conversation as input",
                                no_op=_is(False)),
    "background": _Unhonoured("background responses are not supported", no_op=_is(False)),
    "prompt": _Unhonoured("stored prompt templates are not supported", no_op=_is(False)),
    "truncation": _Unhonoured(_truncation_reason, no_op=_among(("disabled",))),
    "include": _Unhonoured(_include_reason, "a list of strings", _among(_INCLUDED_ANYWAY), item_kind="a string"),
    # a bound on built-in tools' calls, and there are none: any count asks for nothing
    "max_tool_calls": _Unhonoured("", "an integer", _always, lowest=0),
}
_REFUSED = {"chat": _REFUSED_CHAT, "completions": _REFUSED_COMPLETIONS, "responses": _REFUSED_RESPONSES}


def refuse_unsupported(body: dict[str, Any], route: Route) -> None:
    """Raise InvalidArgument naming the first field of `body` (a request to `route`) this
    gateway cannot honour, or one of those fields holding a value of the wrong type."""
    for name, field in _REFUSED[route].items():
        value = body.get(name)
        if value is not None:
            field.refuse(name, value, body)
