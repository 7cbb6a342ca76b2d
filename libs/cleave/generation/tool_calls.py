"""Tool calls out of a model's text, as the text streams, in the two formats served.

Hermes. Models trained on the hermes format (Qwen2.5, Qwen3, Qwen3-MoE and their thinking variants;
their chat templates ask for it when given tools) answer a tool call with a block of JSON:

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

`HermesToolParser` takes the answer text in the pieces it arrives in and gives back the text
that is content (shown as it comes; a possible start of a block is held back until it is
one or is not) and each tool call once its block closed. As vLLM's `hermes` parser does: a
block whose JSON is not an object with a string `name` stays content, tags and all; a block
the sample ended inside (a stop at `</tool_call>`, or the token limit) is parsed as it is;
the whitespace between and after blocks is dropped. It reads the answer, after the thinking
was split off.

Harmony (gpt-oss). A call is a message of its own, addressed to the function in its header:

    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>

(the recipient may stand in the role part instead: `<|start|>assistant to=functions.NAME
<|channel|>...`; the first message of a turn has no `<|start|>assistant`, the prompt ended
with it). `HarmonyToolParser` reads the model's text with its markers, before the thinking
is split off: it takes such messages out whole, with the `<|end|><|start|>assistant` that
led to them, and passes every other message on as it came (held only while a header is
incomplete), so the reasoning parser sees the analysis and final channels it always saw.
`<|call|>` is an end-of-sequence token (its text never arrives): the sample's end closes the
call. A call whose body is not a JSON object stays text, as it was written.
"""

from __future__ import annotations

import enum
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass

from cleave.generation.reasoning import longest_suffix_prefix
from cleave.generation.schema_refs import relocated

START = "<tool_call>"
END = "</tool_call>"
HARMONY_START = "<|start|>assistant"
HARMONY_MESSAGE = "<|message|>"
HARMONY_END = "<|end|>"
HARMONY_CALL = "<|call|>"
HARMONY_MAX_HEADER = 256  # characters of a header at most; a longer one is not a header
_RECIPIENT = re.compile(r"to=functions\.([^\s<]+)")


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
    `<tool_call>` blocks, "harmony" when it addresses messages `to=functions.`, else None (a
    template without tools, or another format)."""
    if not chat_template:
        return None
    if START in chat_template:
        return "hermes"
    return "harmony" if "to=functions" in chat_template else None


def _arguments(value: object) -> str | None:
    """Call arguments (an object, or JSON text of one) as JSON text; None when not an object."""
    try:
        if isinstance(value, str):
            value = json.loads(value)
        return json.dumps(value, ensure_ascii=False) if isinstance(value, dict) else None
    except (ValueError, RecursionError):  # not JSON, or nested past what the parser takes
        return None


def parse_call(body: str) -> ToolCall | None:
    """A hermes block's JSON as a call: {"name": str, "arguments": object or JSON text}
    ("parameters" is taken for "arguments", as some models write it); None when it is not one."""
    try:
        value = json.loads(body)
    except (ValueError, RecursionError):
        return None
    return call_of(value)


def call_of(value: object) -> ToolCall | None:
    """A parsed JSON value as a call ({"name": str, "arguments" or "parameters": object or JSON
    text of one}); None when it is not one."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not value["name"]:
        return None
    arguments = _arguments(value.get("arguments", value.get("parameters", {})))
    return None if arguments is None else ToolCall(value["name"], arguments)


class HermesToolParser:
    """Streaming parser of one sample's answer text (see the module docstring)."""

    def __init__(self) -> None:
        self._held = ""  # text not yet known to be content or a call
        self._in_block = False
        self._searched = 0  # in a block: where the end tag may still start in `_held`
        self._num_calls = 0

    def feed(self, text: str) -> ToolParse:
        """The content and calls `text` completes, with what was held before it."""
        self._held += text
        content: list[str] = []
        calls: list[ToolCall] = []
        while True:
            if self._in_block:  # a block's text is searched once, not again with each piece
                end = self._held.find(END, self._searched)
                if end < 0:
                    self._searched = max(0, len(self._held) - len(END) + 1)
                    break
                self._close_block(self._held[:end], END, content, calls)
                self._held = self._held[end + len(END):]
                continue
            start = self._held.find(START)
            if start >= 0:
                self._emit(self._held[:start], content)
                self._held = self._held[start + len(START):]
                self._in_block, self._searched = True, 0
                continue
            keep = longest_suffix_prefix(self._held, START)
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




class _Harmony(enum.Enum):
    HEADER = "header"  # a message's header, up to <|message|>
    BODY = "body"  # a message passed on
    AFTER_END = "after_end"  # <|end|> seen: a next message may start
    CALL = "call"  # a message to a function: its arguments


class HarmonyToolParser:
    """Streaming parser of one sample's harmony text, markers included (see the module
    docstring): `content` is the text to pass on to the reasoning parser."""

    def __init__(self) -> None:
        self._state = _Harmony.HEADER  # the turn's first message starts at once
        self._held = ""
        self._lead = ""  # "<|end|><|start|>assistant" before the current header, held with it
        self._name = ""  # the function the current call message is addressed to
        self._taken = ""  # the call message's text so far (given back if it is not a call)
        self._searched = 0  # in a call: where its end may still start in `_held`

    def feed(self, text: str) -> ToolParse:
        self._held += text
        out: list[str] = []
        calls: list[ToolCall] = []
        while self._step(out, calls):
            pass
        return ToolParse("".join(out), tuple(calls))

    def finish(self) -> ToolParse:
        out: list[str] = []
        calls: list[ToolCall] = []
        if self._state is _Harmony.CALL:
            self._close_call(self._held, "", out, calls)
        else:
            out.append(self._lead + self._held)
        self._held = self._lead = ""
        self._state = _Harmony.BODY
        return ToolParse("".join(out), tuple(calls))

    def _step(self, out: list[str], calls: list[ToolCall]) -> bool:
        """One move of the state machine over the held text; False when it must wait."""
        held = self._held
        if self._state is _Harmony.HEADER:
            end = held.find(HARMONY_MESSAGE)
            if end < 0:
                if len(held) <= HARMONY_MAX_HEADER:
                    return False
                self._pass_on(self._lead + held, out, _Harmony.BODY)  # too long for a header
                self._held = ""
                return False
            header = held[:end]
            recipient = _RECIPIENT.search(header)
            self._held = held[end + len(HARMONY_MESSAGE):]
            if recipient is None:
                self._pass_on(self._lead + header + HARMONY_MESSAGE, out, _Harmony.BODY)
            else:
                self._name, self._taken = recipient.group(1), self._lead + header + HARMONY_MESSAGE
                self._lead, self._state, self._searched = "", _Harmony.CALL, 0
            return True
        if self._state is _Harmony.CALL:  # a call's text is searched once, not again with each piece
            ends = [i for i in (held.find(HARMONY_CALL, self._searched), held.find(HARMONY_END, self._searched))
                    if i >= 0]
            if not ends:
                self._searched = max(0, len(held) - max(len(HARMONY_CALL), len(HARMONY_END)) + 1)
                return False
            end = min(ends)
            marker = HARMONY_CALL if held.startswith(HARMONY_CALL, end) else HARMONY_END
            self._held = held[end + len(marker):]
            self._close_call(held[:end], marker, out, calls)
            self._state = _Harmony.AFTER_END  # a next message may start; nothing of the call is passed on
            return True
        if self._state is _Harmony.AFTER_END:
            if held.startswith(HARMONY_START):
                self._lead += HARMONY_START
                self._held = held[len(HARMONY_START):]
                self._state = _Harmony.HEADER
                return True
            if HARMONY_START.startswith(held):
                return False  # may still become a message start
            self._pass_on(self._lead, out, _Harmony.BODY)
            return True
        end = held.find(HARMONY_END)  # BODY
        if end < 0:
            keep = longest_suffix_prefix(held, HARMONY_END)
            out.append(held[: len(held) - keep])
            self._held = held[len(held) - keep:]
            return False
        out.append(held[:end])
        self._lead, self._held = HARMONY_END, held[end + len(HARMONY_END):]
        self._state = _Harmony.AFTER_END
        return True

    def _pass_on(self, text: str, out: list[str], state: _Harmony) -> None:
        out.append(text)
        self._lead, self._state = "", state

    def _close_call(self, body: str, terminator: str, out: list[str], calls: list[ToolCall]) -> None:
        """The call message ended (`terminator`: the marker that ended it, "" at the sample's end)."""
        arguments = _arguments(body.strip())
        if arguments is None:  # not a call after all: the message as it was written
            out.append(self._taken + body + terminator)
        else:
            calls.append(ToolCall(self._name, arguments))
        self._taken = self._name = ""


@dataclass(frozen=True)
class ForcedCall:
    """A tool_choice that forces the answer to be calls (decoding constrained to them, see
    `forced_call_schema`): one call of the function `name`, or with `name` None ("required")
    a JSON list of one or more calls of the tools."""

    name: str | None = None


def forced_call_schema(forced: ForcedCall, tools: Sequence[dict], parallel: bool = True) -> dict:
    """The JSON schema the answer is decoded under: the named function's parameters, or a
    list of {"name": <a tool>, "parameters": <its parameters>} (at most one without
    `parallel`), as vLLM constrains tool_choice "required". `tools` are OpenAI's tool objects.
    A tool's local `$ref`s (to its own `$defs`, as pydantic writes them) are rewritten to
    point into its branch of the list, so two tools' same-named `$defs` stay apart."""
    def parameters(tool: dict) -> dict:
        return tool["function"].get("parameters") or {"type": "object"}

    if forced.name is not None:
        return next(parameters(tool) for tool in tools if tool["function"]["name"] == forced.name)
    calls = [{"type": "object", "properties": {
                 "name": {"const": tool["function"]["name"]},
                 "parameters": relocated(parameters(tool), f"#/items/anyOf/{index}/properties/parameters")},
              "required": ["name", "parameters"], "additionalProperties": False}
             for index, tool in enumerate(tools)]
    schema: dict = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
    if not parallel:
        schema["maxItems"] = 1
    return schema


class ForcedCallParser:
    """The answer of a forced tool choice as calls: held back whole, then at the sample's end
    one call of the named function with the answer as its arguments, or ("required") one call
    per entry of the answer's list. An answer that is not what the grammar asked for (the
    token limit cut it) stays content, as written."""

    def __init__(self, forced: ForcedCall) -> None:
        self._forced = forced
        self._parts: list[str] = []

    def feed(self, text: str) -> ToolParse:
        self._parts.append(text)
        return ToolParse()

    def finish(self) -> ToolParse:
        text = "".join(self._parts)
        self._parts = []
        calls = self._calls(text.strip())
        return ToolParse(tool_calls=calls) if calls else ToolParse(content=text)

    def _calls(self, text: str) -> tuple[ToolCall, ...]:
        if self._forced.name is not None:
            arguments = _arguments(text)
            return () if arguments is None else (ToolCall(self._forced.name, arguments),)
        try:
            entries = json.loads(text)
        except (ValueError, RecursionError):
            return ()
        if not isinstance(entries, list):
            return ()
        calls = [call_of(entry) for entry in entries]
        return tuple(calls) if calls and all(calls) else ()


def tool_parser(tool_format: str | ForcedCall) -> HermesToolParser | HarmonyToolParser | ForcedCallParser:
    """A fresh parser of `tool_format` ("hermes", "harmony", or a forced choice's calls) for
    one sample."""
    if isinstance(tool_format, ForcedCall):
        return ForcedCallParser(tool_format)
    if tool_format == "hermes":
        return HermesToolParser()
    if tool_format == "harmony":
        return HarmonyToolParser()
    raise ValueError(f"unknown tool-call format {tool_format!r}; use hermes or harmony")


READS_MARKED_TEXT = frozenset({"harmony"})  # formats parsed before the thinking is split off
