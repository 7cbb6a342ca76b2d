"""OpenAI request fields the gateway cannot honour: refused by name, never silently dropped.

A client that sends `modalities: ["audio"]` expects audio back; answering with text as if the
field were absent is worse than an error. So, as vLLM does for what it cannot serve, each
field below is a 400 naming it when it asks for something (a null, an empty list or the
field's no-op value such as `function_call: "none"` asks for nothing and passes). Fields that
change nothing about the output (`user`, `metadata`, `store`, `service_tier`) are accepted.
Tools (`tools`, `tool_choice`, `parallel_tool_calls`) are served: `openai_tools`; structured
outputs (`response_format`, `structured_outputs`, `guided_*`): `structured_request`.
"""

from __future__ import annotations

from typing import Any

from cleave.errors import InvalidArgument

# field -> why it is refused (the message tells the client what to do instead)
_REFUSED_CHAT = {
    "functions": "the legacy functions API is not supported; use tools",
    "function_call": "the legacy functions API is not supported (only \"none\"); use tool_choice",
    "audio": "audio output is not supported",
    "modalities": "only text output is supported ([\"text\"])",
    "prediction": "predicted outputs are not supported",
    "web_search_options": "web search is not supported",
}
_REFUSED_COMPLETIONS = {
    "suffix": "suffix (insertion) is not supported",
    "best_of": "best_of larger than n is not supported; use n, or the gRPC API's best-of-N scaling",
}


def _asks_nothing(name: str, value: Any, body: dict[str, Any]) -> bool:
    """Whether a refusable field holds its no-op value."""
    if value is None or value == [] or value == {} or value == "":
        return True
    if name == "function_call":
        return value == "none"
    if name == "modalities":
        return value == ["text"]
    if name == "best_of":
        return isinstance(value, int) and not isinstance(value, bool) and value <= max(1, _int(body.get("n"), 1))
    return False


def _int(value: Any, default: int) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else default


def refuse_unsupported(body: dict[str, Any], chat: bool) -> None:
    """Raise InvalidArgument naming the first field of `body` this gateway cannot honour."""
    refused = _REFUSED_CHAT if chat else _REFUSED_COMPLETIONS
    for name, reason in refused.items():
        if name in body and not _asks_nothing(name, body[name], body):
            raise InvalidArgument(reason, field=name)
