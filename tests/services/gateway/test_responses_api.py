"""OpenAI's Responses API (`POST /v1/responses`) through the real `openai` client: the same
tiny checkpoints and scripted answers as the tool-calling tests (`test_tool_calls`), whole
and streamed, with the output items, usage and refusals the API defines."""

from __future__ import annotations

import json

import openai
import pytest

from cleave.errors import InvalidArgument
from cleave.proto.cleave.v1 import common_pb2
from tests.services.gateway.test_harmony_reasoning import harmony_dir  # noqa: F401  (a fixture)
from tests.services.gateway.test_tool_calls import (  # noqa: F401  (fixtures)
    HARMONY_CALL,
    PLAIN,
    TWO_CALLS,
    harmony_tool_model,
    serving,
    tool_model,
)

WEATHER = {"type": "function", "name": "get_weather", "description": "Weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}
TIME = {"type": "function", "name": "get_time", "parameters": {"type": "object"}}


async def test_a_harmony_call_is_a_reasoning_item_then_a_function_call(harmony_tool_model):  # noqa: F811
    async with serving(harmony_tool_model) as (client, backend):
        backend.answer = HARMONY_CALL
        response = await client.responses.create(model="tiny-tools", input="Weather in Paris?", tools=[WEATHER],
                                                 reasoning={"effort": "low"})
    assert response.status == "completed" and response.id.startswith("resp_")
    reasoning, call = response.output
    assert reasoning.type == "reasoning" and [c.text for c in reasoning.content] == ["Need the weather."]
    assert (call.type, call.name, json.loads(call.arguments)) == ("function_call", "get_weather", {"city": "Paris"})
    assert call.call_id.startswith("call_") and call.status == "completed"
    assert response.output_text == ""
    assert response.usage.output_tokens > 0 and response.usage.output_tokens_details.reasoning_tokens > 0
    assert response.reasoning.effort == "low"
    assert "get_weather (call as to=functions.NAME)" in backend.prompts[-1]


async def test_an_answer_is_a_message_with_output_text_and_a_conversation_reaches_the_template(tool_model):  # noqa: F811
    async with serving(tool_model) as (client, backend):
        backend.answer = PLAIN
        response = await client.responses.create(
            model="tiny-tools", instructions="Be brief.", tools=[WEATHER, TIME],
            input=[{"role": "user", "content": "Weather?"},
                   {"type": "function_call", "call_id": "call_1", "name": "get_weather",
                    "arguments": '{"city": "Paris"}'},
                   {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
                   {"role": "user", "content": [{"type": "input_text", "text": "And now?"}]}])
    reasoning, message = response.output
    assert (reasoning.type, message.type, message.role) == ("reasoning", "message", "assistant")
    assert response.output_text == "\n\nIt is sunny." == message.content[0].text
    rendered = backend.prompts[-1]
    assert rendered.startswith("Tools: get_weather=") and "system: Be brief." in rendered
    assert 'assistant: <tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>' in rendered
    assert "tool[call_1]: sunny" in rendered and "user: And now?" in rendered


async def test_streamed_events_build_the_same_response(tool_model):  # noqa: F811
    async with serving(tool_model) as (client, backend):
        backend.answer = TWO_CALLS
        whole = await client.responses.create(model="tiny-tools", input="Weather and time?", tools=[WEATHER, TIME])
        stream = await client.responses.create(model="tiny-tools", input="Weather and time?", tools=[WEATHER, TIME],
                                               stream=True)
        events = [event async for event in stream]
    kinds = [event.type for event in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert [event.sequence_number for event in events] == list(range(len(events)))
    reasoning = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    calls = [e.item for e in events if e.type == "response.output_item.done" and e.item.type == "function_call"]
    assert (reasoning, text) == ("Paris, so two tools.", "\n\nLet me look.\n")
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris"}), ("get_time", {})]
    final = events[-1].response
    assert [item.type for item in final.output] == [item.type for item in whole.output] == [
        "reasoning", "message", "function_call", "function_call"]
    # every item added is done once, in order, and a done item holds what its deltas said
    added = [e.output_index for e in events if e.type == "response.output_item.added"]
    done = [e.output_index for e in events if e.type == "response.output_item.done"]
    assert added == done == [0, 1, 2, 3]
    assert final.output[1].content[0].text == text and final.usage.output_tokens == whole.usage.output_tokens


async def test_a_token_limit_makes_the_response_incomplete(tool_model):  # noqa: F811
    async with serving(tool_model) as (client, backend):
        backend.answer = PLAIN
        backend.finish = common_pb2.FINISH_REASON_LENGTH
        response = await client.responses.create(model="tiny-tools", input="Weather?", max_output_tokens=3)
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"


async def test_a_json_schema_format_and_a_forced_call_constrain_the_answer(tool_model):  # noqa: F811
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    async with serving(tool_model) as (client, backend):
        backend.answer = 'Rome.</think>\n\n{"city": "Rome"}'
        response = await client.responses.create(
            model="tiny-tools", input="Where?", text={"format": {"type": "json_schema", "name": "place", "schema": schema}})
        assert json.loads(response.output_text) == {"city": "Rome"}
        assert response.text.format.type == "json_schema"
        assert json.loads(backend.specs[-1].sampling.structured_output.spec) == schema
        response = await client.responses.create(model="tiny-tools", input="Weather?", tools=[WEATHER],
                                                 tool_choice={"type": "function", "name": "get_weather"})
        (call,) = [item for item in response.output if item.type == "function_call"]
        assert (call.name, json.loads(call.arguments)) == ("get_weather", {"city": "Rome"})


@pytest.mark.parametrize("fields, param", [
    ({"previous_response_id": "resp_1"}, "previous_response_id"),
    ({"background": True}, "background"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": [1]}}}, "text.format.schema"),
    ({"text": {"format": {"type": "yaml"}}}, "text.format.type"),
    ({"text": "json"}, "text"),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"tools": [{"type": "function", "name": ""}]}, "tools[0].name"),
    ({"tools": [{"type": "function", "name": "f", "parameters": [1]}]}, "tools[0].parameters"),
    ({"input": [{"type": "image", "url": "x"}]}, "input[0].type"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{oops"}]}, "input[0].arguments"),
    ({"input": [{"type": "function_call_output", "output": "x"}]}, "input[0].call_id"),
    ({"input": [{"role": "wizard", "content": "x"}]}, "input[0].role"),
    ({"input": []}, "input"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"reasoning": {"effort": "extreme"}}, "reasoning.effort"),
    ({"tool_choice": {"type": "function", "name": "get_stock"}, "tools": [WEATHER]}, "tool_choice.name"),
    ({"tool_choice": "required"}, "tool_choice"),
    # once ignored at any value
    ({"truncation": "auto"}, "truncation"),
    ({"truncation": "x"}, "truncation"),
    ({"include": "x"}, "include"),
    ({"include": ["reasoning.encrypted_content", "message.output_text.logprobs"]}, "include[1]"),
    ({"include": ["x"]}, "include[0]"),
    ({"max_tool_calls": "x"}, "max_tool_calls"),
    ({"max_tool_calls": -1}, "max_tool_calls"),
    ({"top_logprobs": 50}, "top_logprobs"),
])
async def test_what_cannot_be_honoured_is_a_400_naming_the_field(tool_model, fields, param):  # noqa: F811
    async with serving(tool_model) as (client, _):
        with pytest.raises(openai.BadRequestError) as raised:
            await client.responses.create(model="tiny-tools", **{"input": "hi", **fields})
    assert raised.value.body["param"] == param


@pytest.mark.parametrize("fields, param, reason", [
    ({"previous_response_id": "resp_1"}, "previous_response_id", "send the whole conversation"),
    ({"truncation": "auto"}, "truncation", "the input is never truncated"),
    ({"truncation": 5}, "truncation", "must be \"auto\" or \"disabled\""),
    ({"include": ["reasoning.encrypted_content", "message.output_text.logprobs"]}, "include[1]",
     "use /v1/chat/completions with logprobs"),
    ({"include": ["file_search_call.results", 3]}, "include[1]", "must be a string"),
    ({"include": ["x"]}, "include[0]", "not an include value"),
    ({"include": {"a": 1}}, "include", "must be a list of strings"),
    ({"max_tool_calls": True}, "max_tool_calls", "must be an integer"),
    ({"max_tool_calls": -1}, "max_tool_calls", "must be an integer >= 0"),
])
def test_refusals_name_the_field_and_say_why(fields, param, reason):
    from services.gateway.responses_api import responses_body

    with pytest.raises(InvalidArgument) as raised:
        responses_body({"input": "hi", **fields})
    assert raised.value.field == param and reason in raised.value.message


def test_fields_that_ask_for_nothing_here_are_accepted():
    from services.gateway.responses_api import responses_body

    responses_body({"input": "hi", "truncation": "disabled", "include": ["reasoning.encrypted_content"],
                    "max_tool_calls": 3, "top_logprobs": 20})
    responses_body({"input": "hi", "truncation": None, "include": [], "max_tool_calls": None})


def test_a_cache_salt_is_passed_on_to_the_chat_request():
    from services.gateway.responses_api import responses_body

    assert responses_body({"input": "hi", "cache_salt": "tenant-a"})["cache_salt"] == "tenant-a"
    assert "cache_salt" not in responses_body({"input": "hi"})


def test_a_priority_is_passed_on_to_the_chat_request():
    from services.gateway.responses_api import responses_body

    assert responses_body({"input": "hi", "priority": -2})["priority"] == -2
    assert "priority" not in responses_body({"input": "hi"})
