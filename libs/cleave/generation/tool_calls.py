"""Tool calls out of a model's answer text, as the text streams.

Models trained on the hermes format (Qwen2.5, Qwen3, Qwen3-MoE and their thinking variants;
their chat templates ask for it when given tools) answer a tool call with a block of JSON:

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

`HermesToolParser` takes the answer text in the pieces it arrives in and gives back the text
that is content (shown as it comes; a possible start of a block is held back until it is
one or is not) and each tool call once its block closed. As vLLM's `hermes` parser does: a
block whose JSON is not an object with a string `name` stays content, tags and all; a block
the sample ended inside (a stop at `</tool_call>`, or the token limit) is parsed as it is;
the whitespace between and after blocks is dropped.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

START = "<tool_call>"
END = "</tool_call>"


@dataclass(frozen=True)
class ToolCall:
    """One function call: its name and its arguments as JSON text (an object)."""

    name: str
    arguments: str


@dataclass(frozen=True)
class ToolParse:
    """What a piece of answer text holds: content to show now, and the calls it completed."""

    content: str = ""
    tool_calls: tuple[ToolCall, ...] = ()


def tool_call_format(chat_template: str | None) -> str | None:
    """The tool-call format a chat template asks its model for: "hermes" when it writes
    `<tool_call>` blocks, else None (a template without tools, or another format)."""
    return "hermes" if chat_template and START in chat_template else None


def parse_call(body: str) -> ToolCall | None:
    """A hermes block's JSON as a call: {"name": str, "arguments": object or JSON text}
    ("parameters" is taken for "arguments", as some models write it); None when it is not one."""
    try:
        value = json.loads(body)
    except ValueError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not value["name"]:
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ToolCall(value["name"], json.dumps(arguments, ensure_ascii=False))


class HermesToolParser:
    """Streaming parser of one sample's answer text (see the module docstring)."""

    def __init__(self) -> None:
        self._held = ""  # text not yet known to be content or a call
        self._in_block = False
        self._num_calls = 0

    def feed(self, text: str) -> ToolParse:
        """The content and calls `text` completes, with what was held before it."""
        self._held += text
        content: list[str] = []
        calls: list[ToolCall] = []
        while True:
            if self._in_block:
                end = self._held.find(END)
                if end < 0:
                    break
                self._close_block(self._held[:end], END, content, calls)
                self._held = self._held[end + len(END):]
                continue
            start = self._held.find(START)
            if start >= 0:
                self._emit(self._held[:start], content)
                self._held = self._held[start + len(START):]
                self._in_block = True
                continue
            keep = _partial_tag_length(self._held)
            ready, self._held = self._held[: len(self._held) - keep], self._held[len(self._held) - keep:]
            if self._num_calls and not ready.strip():  # whitespace after a call: held until text follows
                self._held = ready + self._held
            else:
                self._emit(ready, content)
            break
        return ToolParse("".join(content), tuple(calls))

    def finish(self) -> ToolParse:
        """The sample ended: a block still open is parsed as it is, held text is content
        (whitespace after a call is dropped)."""
        content: list[str] = []
        calls: list[ToolCall] = []
        if self._in_block:
            self._close_block(self._held, "", content, calls)
        elif not (self._num_calls and not self._held.strip()):
            self._emit(self._held, content)
        self._held, self._in_block = "", False
        return ToolParse("".join(content), tuple(calls))

    def _close_block(self, body: str, end_tag: str, content: list[str], calls: list[ToolCall]) -> None:
        """A block's end (`end_tag`: the tag that closed it, "" when the sample ended)."""
        self._in_block = False
        call = parse_call(body)
        if call is None:  # not a call: the model's text, as it wrote it
            self._emit(START + body + end_tag, content)
            return
        calls.append(call)
        self._num_calls += 1

    def _emit(self, text: str, content: list[str]) -> None:
        if self._num_calls and not text.strip():
            return  # the whitespace between and after blocks
        if text:
            content.append(text)


def _partial_tag_length(text: str) -> int:
    """Length of the longest suffix of `text` that begins a start tag."""
    for length in range(min(len(START) - 1, len(text)), 0, -1):
        if START.startswith(text[-length:]):
            return length
    return 0
