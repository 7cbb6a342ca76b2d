"""Structured outputs through the whole stack, in both modes, driven by the real `openai`
client: the answers of a random tiny model decoded under `response_format` (a JSON schema,
JSON mode) and vLLM's regex and choice constraints are what `jsonschema`, `json` and `re`
accept, equal the in-process engine's under the same constraint, stream in pieces that add
up, and leave the thinking free; a spec no grammar can be made of is a 400 naming its field."""

from __future__ import annotations

import json
import re

import grpc
import jsonschema
import openai
import pytest

from cleave.client import GatewayClient
from cleave.generation.sampling_params import SamplingParams
from cleave.generation.structured_output import StructuredOutput
from cleave.proto.cleave.v1 import common_pb2
from tests.services.gateway.helpers import free_blocks, reference_llm, wait_for_free_blocks

pytestmark = pytest.mark.asyncio(loop_scope="module")
MESSAGES = [{"role": "user", "content": "Describe the sky as JSON."}]
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[a-z]{1,5}$"},
        "clear": {"type": "boolean"},
        "color": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2},
    },
    "required": ["name", "clear", "color", "tags"],
    "additionalProperties": False,
}
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "sky", "schema": SCHEMA, "strict": True}}
DEEP_SCHEMA = json.loads('{"type":"array","items":' * 200 + '{"type":"string"}' + "}" * 200)
THINK = {"max_thinking_tokens": 2}  # the random model would think to the token limit; the grammar starts after


def client(stack) -> openai.AsyncOpenAI:
    return stack.openai()  # closed with the stack


async def test_a_json_schema_answer_is_an_instance_and_equals_the_engines(stack, model_dir):
    response = await client(stack).chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=120, temperature=0.0, response_format=RESPONSE_FORMAT,
        extra_body=THINK)
    choice = response.choices[0]
    jsonschema.validate(json.loads(choice.message.content), SCHEMA)
    assert choice.finish_reason == "stop"
    assert choice.message.reasoning_content  # thought first, unconstrained
    (expected,) = reference_llm(model_dir).generate(MESSAGES, SamplingParams(
        max_tokens=120, temperature=0.0, max_thinking_tokens=2,
        structured_output=StructuredOutput.json_schema(SCHEMA)))
    assert choice.message.content == expected.outputs[0].text
    assert choice.message.reasoning_content == expected.outputs[0].reasoning_text


async def test_sampled_answers_stream_and_every_sample_is_an_instance(stack):
    stream = await client(stack).chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=120, temperature=1.0, seed=7, n=3, stream=True,
        response_format=RESPONSE_FORMAT, extra_body=THINK)
    contents = {0: "", 1: "", 2: ""}
    finishes = {}
    async for chunk in stream:
        for choice in chunk.choices:
            contents[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                finishes[choice.index] = choice.finish_reason
    for content in contents.values():
        jsonschema.validate(json.loads(content), SCHEMA)
    assert finishes == {0: "stop", 1: "stop", 2: "stop"}


async def test_json_mode_regex_and_choice(stack):
    json_mode = await client(stack).chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=150, temperature=0.0, response_format={"type": "json_object"},
        extra_body=THINK)
    text = json_mode.choices[0].message.content
    if json_mode.choices[0].finish_reason == "stop":  # free-form JSON may outrun the token limit
        assert isinstance(json.loads(text), dict)
    else:
        assert text.startswith("{")
    choice = await client(stack).chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=30, temperature=1.0, seed=5,
        extra_body={**THINK, "guided_choice": ["cloudy", "clear sky", "storm"]})
    assert choice.choices[0].message.content in ("cloudy", "clear sky", "storm")


async def test_a_regex_answer_after_a_forced_end_of_thinking(stack):
    response = await client(stack).chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=40, temperature=1.0, seed=11,
        extra_body={**THINK, "structured_outputs": {"regex": r"[A-Z]{2}-[0-9]{3}"}})
    assert re.fullmatch(r"[A-Z]{2}-[0-9]{3}", response.choices[0].message.content)


@pytest.mark.parametrize(("body", "param"), [
    # the workers' compiler refuses these: named as the client sent them, not `structured_output`
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
     "response_format.json_schema.schema"),
    ({"guided_regex": "("}, "guided_regex"),
    ({"guided_grammar": "x"}, "guided_grammar"),
    ({"guided_json": {"type": "nonsense"}}, "guided_json"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": [1]}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "yaml"}}, "response_format.type"),
    ({"structured_outputs": {"regex": "((("}}, "structured_outputs.regex"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ({"structured_outputs": {"jsn": {"type": "object"}}}, "structured_outputs.jsn"),  # misspelt: not free text
    ({"structured_outputs": {"regex": "[a-z]+", "disable_fallback": True}}, None),  # what the workers do anyway
    ({"structured_outputs": {"regex": "a", "whitespace_pattern": " "}}, "structured_outputs.whitespace_pattern"),
    ({"guided_choice": []}, None),  # asks for nothing
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex"),
    ({"tool_choice": "required"}, "tool_choice"),
    # nested past MAX_SCHEMA_DEPTH: compiling such schemas takes superlinear time (1000 levels: 46 s)
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": DEEP_SCHEMA}}},
     "response_format.json_schema.schema"),
])
async def test_bad_constraints_are_refused_naming_the_field(stack, body, param):
    request = client(stack).chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=5, temperature=0.0, extra_body={**THINK, **body})
    if param is None:
        await request
        return
    with pytest.raises(openai.BadRequestError) as raised:
        await request
    assert raised.value.body["param"] == param, raised.value.body
    assert "worker" not in raised.value.body["message"], raised.value.body  # the request's fault, not a worker's


async def test_a_constraint_the_workers_cannot_compile_is_named_as_each_route_took_it(stack):
    with pytest.raises(openai.BadRequestError) as raised:
        await client(stack).completions.create(model="tiny", prompt="Sky:", max_tokens=5,
                                               extra_body={"guided_regex": "("})
    assert raised.value.body["param"] == "guided_regex", raised.value.body
    with pytest.raises(openai.BadRequestError) as raised:
        await client(stack).responses.create(model="tiny", input="Sky?", max_output_tokens=5, text={"format": {
            "type": "json_schema", "name": "x", "schema": {"type": "nonsense"}}})
    assert raised.value.body["param"] == "text.format.schema", raised.value.body


async def test_a_reference_out_of_the_schema_is_refused_on_every_route(stack):
    # nothing is fetched: xgrammar compiled such a $ref as any JSON value, and the answer went
    # unconstrained there ("sky": true); a local one constrains it
    remote = {"type": "object", "properties": {"sky": {"$ref": "https://example.com/sky.json"}}, "required": ["sky"]}
    local = {**remote, "properties": {"sky": {"$ref": "#/$defs/sky"}}, "$defs": {"sky": SCHEMA}}
    refusals = {
        "response_format.json_schema.schema": lambda: client(stack).chat.completions.create(
            model="tiny", messages=MESSAGES, max_tokens=5, extra_body={**THINK, "response_format": {
                "type": "json_schema", "json_schema": {"name": "x", "schema": remote}}}),
        "guided_json": lambda: client(stack).chat.completions.create(
            model="tiny", messages=MESSAGES, max_tokens=5, extra_body={**THINK, "guided_json": remote}),
        "text.format.schema": lambda: client(stack).responses.create(
            model="tiny", input="Sky?", max_output_tokens=5,
            text={"format": {"type": "json_schema", "name": "x", "schema": remote}}),
    }
    for param, request in refusals.items():
        with pytest.raises(openai.BadRequestError) as raised:
            await request()
        assert raised.value.body["param"] == param, raised.value.body
        assert "only local references are supported" in raised.value.body["message"], raised.value.body
    reasoning = common_pb2.ReasoningOptions(max_thinking_tokens=2)
    async with GatewayClient(stack.gateway_address) as grpc_client:
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            await grpc_client.complete(MESSAGES, max_tokens=5, reasoning=reasoning,
                                       structured_output=common_pb2.StructuredOutput(json_schema=json.dumps(remote)))
        result = await grpc_client.complete(
            MESSAGES, max_tokens=150, temperature=1.0, seed=3, reasoning=reasoning,
            structured_output=common_pb2.StructuredOutput(json_schema=json.dumps(local)))
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert raised.value.details().startswith("sampling.structured_output: schema's $ref 'https://example.com/sky.json'")
    jsonschema.validate(json.loads(result.samples[0].text), local)


async def test_a_loop_of_references_is_refused_by_the_gateway(stack):
    # the workers' compiler refuses it too ("Circular $ref chain"), after compiling what it reached first
    loop = {"type": "object", "properties": {"sky": {"$ref": "#/$defs/a"}}, "required": ["sky"],
            "$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}}
    named = "$ref chain #/$defs/a -> #/$defs/b -> #/$defs/a comes back to itself"
    with pytest.raises(openai.BadRequestError) as raised:
        await client(stack).chat.completions.create(
            model="tiny", messages=MESSAGES, max_tokens=5, extra_body={**THINK, "structured_outputs": {"json": loop}})
    assert raised.value.body["param"] == "structured_outputs.json", raised.value.body
    assert named in raised.value.body["message"] and "compile" not in raised.value.body["message"], raised.value.body
    async with GatewayClient(stack.gateway_address) as grpc_client:
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            await grpc_client.complete(MESSAGES, max_tokens=5,
                                       structured_output=common_pb2.StructuredOutput(json_schema=json.dumps(loop)))
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert raised.value.details().startswith(f"sampling.structured_output: schema's {named}"), raised.value.details()


async def test_refused_constraints_leave_no_kv_behind(stack):
    before = free_blocks(stack)
    for _ in range(3):
        with pytest.raises(openai.BadRequestError):
            await client(stack).chat.completions.create(
                model="tiny", messages=MESSAGES, max_tokens=5,
                extra_body={**THINK, "structured_outputs": {"grammar": "root ::= ((("}})
    assert await wait_for_free_blocks(stack, before) == before


async def test_grpc_clients_set_the_constraint_in_sampling_params(stack):
    reasoning = common_pb2.ReasoningOptions(max_thinking_tokens=2)
    async with GatewayClient(stack.gateway_address) as client:
        result = await client.complete(
            MESSAGES, max_tokens=120, temperature=1.0, seed=2, reasoning=reasoning,
            structured_output=common_pb2.StructuredOutput(json_schema=json.dumps(SCHEMA)))
        jsonschema.validate(json.loads(result.samples[0].text), SCHEMA)
        choice = await client.complete(
            MESSAGES, max_tokens=30, temperature=1.0, seed=4, reasoning=reasoning,
            structured_output=common_pb2.StructuredOutput(choice=common_pb2.StringChoices(choices=["up", "down"])))
        assert choice.samples[0].text in ("up", "down")
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            await client.complete(MESSAGES, max_tokens=5, reasoning=reasoning,
                                  structured_output=common_pb2.StructuredOutput(regex="((("))
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "sampling.structured_output" in raised.value.details()
    # 2000 levels in 50 KB (under the size bound): refused, where compiling it would take minutes
    deep = '{"type":"array","items":' * 2000 + '{"type":"string"}' + "}" * 2000
    async with GatewayClient(stack.gateway_address) as client:
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            await client.complete(MESSAGES, max_tokens=5, reasoning=reasoning,
                                  structured_output=common_pb2.StructuredOutput(json_schema=deep))
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "sampling.structured_output" in raised.value.details() and "levels" in raised.value.details()
