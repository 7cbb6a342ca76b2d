"""Hermes tool calls out of streamed answer text: every way of cutting the text into pieces
gives the same content and calls; blocks that are not calls stay content as written; a block
the sample ended inside is parsed as it is; whitespace around calls is dropped."""

from __future__ import annotations

import json
import random

import pytest

from cleave.generation.tool_calls import HarmonyToolParser, HermesToolParser, ToolCall, parse_call, tool_call_format

WEATHER = ToolCall("get_weather", json.dumps({"city": "Paris", "unit": "°C"}, ensure_ascii=False))
TIME = ToolCall("get_time", "{}")


def block(name: str, arguments: object, key: str = "arguments") -> str:
    return f"<tool_call>\n{json.dumps({'name': name, key: arguments}, ensure_ascii=False)}\n</tool_call>"


CASES = [
    # (answer text, content, calls)
    ("The answer is 4.", "The answer is 4.", []),
    ("Let me check." + "\n" + block("get_weather", {"city": "Paris", "unit": "°C"}),
     "Let me check.\n", [WEATHER]),
    (block("get_weather", {"city": "Paris", "unit": "°C"}) + "\n\n" + block("get_time", {}) + "\n",
     "", [WEATHER, TIME]),
    (block("get_time", "{}") + "\nDone.", "\nDone.", [TIME]),  # arguments as JSON text; text after a call stays
    (block("get_time", {}, key="parameters"), "", [TIME]),
    ("<tool_call>\nnot json\n</tool_call> then text", "<tool_call>\nnot json\n</tool_call> then text", []),
    (block("get_time", [1, 2]), block("get_time", [1, 2]), []),  # arguments not an object: not a call
    ('<tool_call>{"arguments": {}}</tool_call>', '<tool_call>{"arguments": {}}</tool_call>', []),  # no name
    ('<tool_call>\n{"name": "get_time", "arguments": {}}', "", [TIME]),  # ended inside the block
    ("<tool_call>\n{\"name\": \"get_ti", "<tool_call>\n{\"name\": \"get_ti", []),  # cut mid-JSON
    ("a <tool_ b <tool", "a <tool_ b <tool", []),  # tag starts that never became tags
    ("x < y", "x < y", []),
]


def run(pieces: list[str], parser: HermesToolParser | HarmonyToolParser | None = None) -> tuple[str, list[ToolCall]]:
    parser = parser or HermesToolParser()
    content, calls = [], []
    for piece in pieces + [None]:
        parsed = parser.feed(piece) if piece is not None else parser.finish()
        content.append(parsed.content)
        calls.extend(parsed.tool_calls)
    return "".join(content), calls


def cuttings(text: str, rng: random.Random) -> list[list[str]]:
    """Whole, one character at a time, and random cuts."""
    ways = [[text], list(text)]
    for _ in range(20):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 6)))) if len(text) > 1 else []
        bounds = [0, *cuts, len(text)]
        ways.append([text[a:b] for a, b in zip(bounds, bounds[1:])])
    return ways


@pytest.mark.parametrize("text, content, calls", CASES)
def test_every_cutting_gives_the_same_content_and_calls(text, content, calls):
    rng = random.Random(len(text))
    for pieces in cuttings(text, rng):
        assert run(pieces) == (content, calls), pieces


def test_content_before_a_tag_is_not_held_longer_than_the_tag_could_be():
    parser = HermesToolParser()
    assert parser.feed("Sure, <tool").content == "Sure, "  # "<tool" may begin a block
    assert parser.feed("box> is here").content == "<toolbox> is here"
    parsed = parser.feed(block("get_time", {}))
    assert (parsed.content, parsed.tool_calls) == ("", (TIME,))  # the call as soon as its block closes
    assert parser.feed("\n\n").content == ""  # whitespace after a call waits for text
    assert parser.feed("More.").content == "\n\nMore."


def test_parse_call_refuses_what_is_not_a_call():
    assert parse_call('{"name": "f", "arguments": {"a": 1}}') == ToolCall("f", '{"a": 1}')
    assert parse_call('{"name": "f"}') == ToolCall("f", "{}")
    for body in ('{"name": ""}', '{"name": 3}', "[1]", '{"name": "f", "arguments": "not json"}', "", "{"):
        assert parse_call(body) is None, body
    # nested past what Python's JSON parser takes (a model can write anything): not a call, no error
    deep = "[" * 100_000 + "]" * 100_000
    for body in (deep, '{"name": "f", "arguments": ' + json.dumps('{"a": ' + deep + "}") + "}"):
        assert parse_call(body) is None


def test_the_format_comes_from_the_chat_template():
    assert tool_call_format("{% if tools %}<tool_call>{{ tools }}</tool_call>{% endif %}") == "hermes"
    assert tool_call_format("{{ '<|start|>assistant to=functions.' + name }}") == "harmony"
    assert tool_call_format("{{ messages }}") is None
    assert tool_call_format(None) is None


ANALYSIS = "<|channel|>analysis<|message|>Need the weather.<|end|>"
FINAL = "<|start|>assistant<|channel|>final<|message|>It is sunny."
PARIS = ToolCall("get_weather", json.dumps({"city": "Paris"}))
HARMONY_CASES = [
    # (the model's text, what goes on to the reasoning parser, calls)
    (ANALYSIS + '<|start|>assistant<|channel|>commentary to=functions.get_weather json<|message|>{"city": "Paris"}',
     "<|channel|>analysis<|message|>Need the weather.", [PARIS]),
    (ANALYSIS + '<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{"city":"Paris"}<|call|>',
     "<|channel|>analysis<|message|>Need the weather.", [PARIS]),  # the recipient in the role part
    ('<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|> {"city": "Paris"} ', "", [PARIS]),
    (ANALYSIS + FINAL, ANALYSIS + FINAL, []),  # no call: passed on as it came
    (ANALYSIS + "<|start|>assistant<|channel|>commentary<|message|>Checking.<|end|>" + FINAL,
     ANALYSIS + "<|start|>assistant<|channel|>commentary<|message|>Checking.<|end|>" + FINAL, []),  # a preamble
    ("<|channel|>commentary to=functions.f json<|message|>not json",
     "<|channel|>commentary to=functions.f json<|message|>not json", []),  # not a call: as written
    ("<|channel|>commentary to=functions.f json<|message|>[1]<|end|>" + FINAL,
     "<|channel|>commentary to=functions.f json<|message|>[1]<|end|>" + FINAL, []),
    ("x" * 300 + "<|message|>to=functions.f", "x" * 300 + "<|message|>to=functions.f", []),  # no header that long
    ("<|channel|>analysis<|message|>a <|en", "<|channel|>analysis<|message|>a <|en", []),
]


@pytest.mark.parametrize("text, passed_on, calls", HARMONY_CASES)
def test_harmony_calls_come_out_whole_and_every_other_message_passes_on(text, passed_on, calls):
    rng = random.Random(len(text))
    for pieces in cuttings(text, rng):
        assert run(pieces, HarmonyToolParser()) == (passed_on, calls), pieces


def test_harmony_passes_a_body_on_as_it_streams():
    parser = HarmonyToolParser()
    assert parser.feed("<|channel|>analysis<|mess").content == ""  # a header: held until complete
    assert parser.feed("age|>Think").content == "<|channel|>analysis<|message|>Think"
    assert parser.feed("ing<|e").content == "ing"  # "<|e" may begin <|end|>
    assert parser.feed("nd|><|start|>assistant<|channel|>final").content == ""  # the next header decides
    assert parser.feed("<|message|>Done").content == "<|end|><|start|>assistant<|channel|>final<|message|>Done"
