"""Tool calling through both front doors: the real `openai` client on /v1/chat/completions
and the gRPC stub.

The model is the tiny reasoning checkpoint with a chat template that describes tools and
asks for hermes `<tool_call>` blocks (as Qwen3's does), or harmony messages to a function (as
gpt-oss's does). Its answers are scripted: a backend renders each request's prompt with the
served model (the template sees the tools and the earlier calls) and streams the token ids
of a fixed answer, a few tokens a step, through the gateway's own `stream_samples`, so the
tags arrive split over tokens and steps.
"""

from __future__ import annotations

import contextlib
import json
import shutil
from collections.abc import AsyncIterator

import grpc
import jsonschema
import openai
import pydantic
import pytest
import xgrammar

from cleave.config import ModelConfig as ServedModelConfig
from cleave.engine.grammar import GrammarCompiler
from cleave.errors import InvalidArgument
from cleave.generation.outputs import FinishReason
from cleave.generation.reasoning_formats import special_tag_tokens
from cleave.generation.sampling_params import SamplingParams
from cleave.generation.structured_output import StructuredOutput
from cleave.proto.cleave.v1 import common_pb2, decode_pb2, gateway_pb2, gateway_pb2_grpc
from cleave.rpc import aio_channel, serve
from cleave.rpc.types import ReasoningMode
from services.gateway.__main__ import registration
from services.gateway.backend import GenerateChunk, GenerateSpec, Prompt
from services.gateway.convert import TokenDelta
from services.gateway.delta_queue import DeltaQueue
from services.gateway.http_api import OpenAIApi, bound_port, start_http
from services.gateway.model import ServedModel
from services.gateway.placement import RunningRequest, WorkerRequest
from services.gateway.request_stream import stream_samples
from services.gateway.sample_text import SampleText
from services.gateway.servicer import GatewayServicer
from tests.services.gateway.test_harmony_reasoning import harmony_dir  # noqa: F401  (a fixture)

TEMPLATE = (
    "{% if tools %}Tools:{% for tool in tools %} {{ tool.function.name }}="
    "{{ tool.function.parameters | default({}) | tojson }}"
    "{% endfor %}\nCall one as <tool_call>{\"name\": ..., \"arguments\": ...}</tool_call>\n{% endif %}"
    "{% for m in messages %}{% if m.role == 'tool' %}tool[{{ m.tool_call_id }}]: {{ m.content }}\n"
    "{% else %}{{ m.role }}: {{ m.content }}"
    "{% for call in m.tool_calls or [] %}<tool_call>{\"name\": \"{{ call.function.name }}\", "
    "\"arguments\": {{ call.function.arguments | tojson }}}</tool_call>{% endfor %}\n{% endif %}{% endfor %}"
    "{% if messages[-1].role == 'system' %}{{ raise_exception('the conversation must not end with a system turn') }}"
    "{% endif %}assistant: <think>"
)
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME_TOOL = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}
MESSAGES = [{"role": "user", "content": "Weather and time in Paris?"}]
TWO_CALLS = ("Paris, so two tools.</think>\n\nLet me look.\n"
             '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
             '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')
PLAIN = "Easy.</think>\n\nIt is sunny."


@pytest.fixture(scope="module")
def tool_model(model_dir, tmp_path_factory) -> ServedModel:
    directory = tmp_path_factory.mktemp("tools")
    for name in ("config.json", "tokenizer.json", "generation_config.json", "cleave_config.json"):
        shutil.copy(model_dir / name, directory / name)
    tokenizer_config = json.loads((model_dir / "tokenizer_config.json").read_text())
    (directory / "tokenizer_config.json").write_text(json.dumps({**tokenizer_config, "chat_template": TEMPLATE}))
    return ServedModel(ServedModelConfig(source=str(directory), served_name="tiny-tools"))


class ScriptedBackend:
    """Answers every request with `answer`'s tokens, three a step, ending at eos: the deltas a
    decode worker would stream, through the gateway's own `stream_samples` (the SampleText it
    builds for the spec and model, the tags' special tokens given their text back)."""

    def __init__(self, model: ServedModel) -> None:
        self.model = model
        self.answer = TWO_CALLS
        self.finish = common_pb2.FINISH_REASON_STOP  # how the answer ends
        self.prompts: list[str] = []
        self.specs: list[GenerateSpec] = []

    async def generate(self, spec: GenerateSpec) -> AsyncIterator[GenerateChunk]:
        model = self.model
        prompt_ids = model.encode(spec.prompt, spec.reasoning)
        self.prompts.append(model.tokenizer.decode(prompt_ids))
        self.specs.append(spec)
        ids = model.tokenizer.encode(self.answer, add_special_tokens=False)
        running = RunningRequest(DeltaQueue())
        running.add(WorkerRequest("worker-request", decode=None, stream=None, sample_indices=(0,)))  # type: ignore[arg-type]
        for start in range(0, len(ids), 3):
            last = start + 3 >= len(ids)
            running.queue.put_nowait(decode_pb2.RequestDelta(
                request_id="worker-request", token_ids=ids[start:start + 3],
                finish_reason=self.finish if last else common_pb2.FINISH_REASON_UNSPECIFIED))

        async def no_migration(lost, texts):  # type: ignore[no-untyped-def]
            raise AssertionError("no worker is lost here")

        async for chunk in stream_samples(spec, prompt_ids, 0, running, [False], model=model,
                                          tag_tokens=special_tag_tokens(model.tokenizer, model.reasoning),
                                          migrate=no_migration, abort_sample=lambda index: None):
            yield chunk


@contextlib.asynccontextmanager
async def serving(model: ServedModel) -> AsyncIterator[tuple[openai.AsyncOpenAI, ScriptedBackend]]:
    """The HTTP API over a ScriptedBackend of `model`, and an `openai` client of it."""
    backend = ScriptedBackend(model)
    runner = await start_http(OpenAIApi(backend, [model.config], str), "127.0.0.1:0")
    try:
        client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{bound_port(runner)}/v1", api_key="unused",
                                    max_retries=0)
        async with client:
            yield client, backend
    finally:
        await runner.cleanup()


@pytest.fixture
async def api(tool_model):
    async with serving(tool_model) as running:
        yield running


async def test_calls_come_back_apart_from_the_content(api):
    client, backend = api
    response = await client.chat.completions.create(model="tiny-tools", messages=MESSAGES,
                                                    tools=[WEATHER_TOOL, TIME_TOOL])
    (choice,) = response.choices
    assert choice.finish_reason == "tool_calls"
    assert choice.message.reasoning_content == "Paris, so two tools."
    assert choice.message.content == "\n\nLet me look.\n"
    calls = choice.message.tool_calls
    assert [(c.type, c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("function", "get_weather", {"city": "Paris"}), ("function", "get_time", {})]
    assert len({c.id for c in calls}) == 2 and all(c.id.startswith("call_") for c in calls)
    # the template described both tools to the model
    assert backend.prompts[-1].startswith('Tools: get_weather={"type": "object", "properties"')
    assert " get_time=" in backend.prompts[-1]


async def streamed(stream) -> tuple[str, list, str | None]:  # type: ignore[no-untyped-def]
    """A streamed one-choice answer's content, tool-call deltas and finish reason."""
    content, calls, finish = "", [], None
    async for chunk in stream:
        (choice,) = chunk.choices
        content += choice.delta.content or ""
        calls += choice.delta.tool_calls or []
        finish = choice.finish_reason or finish
    return content, calls, finish


async def test_streamed_calls_arrive_whole_with_their_index(api):
    client, _ = api
    stream = await client.chat.completions.create(model="tiny-tools", messages=MESSAGES, tools=[WEATHER_TOOL, TIME_TOOL],
                                                  tool_choice="auto", stream=True)
    content, calls, finish = await streamed(stream)
    assert content == "\n\nLet me look.\n" and finish == "tool_calls"
    assert [(c.index, c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        (0, "get_weather", {"city": "Paris"}), (1, "get_time", {})]
    assert all(c.id and c.type == "function" for c in calls)


async def test_without_parallel_calls_the_first_call_is_kept(api, grpc_stub):
    client, _ = api
    response = await client.chat.completions.create(model="tiny-tools", messages=MESSAGES,
                                                    tools=[WEATHER_TOOL, TIME_TOOL], parallel_tool_calls=False)
    (choice,) = response.choices
    assert [c.function.name for c in choice.message.tool_calls] == ["get_weather"]
    assert choice.finish_reason == "tool_calls"
    stub, _ = grpc_stub
    deltas = [d async for r in stub.Generate(grpc_chat(tools=GRPC_TOOLS, parallel_tool_calls=False)) for d in r.samples]
    assert [c.name for d in deltas for c in d.tool_calls] == ["get_weather"]


async def test_tool_choice_none_leaves_the_answer_as_text(api):
    client, backend = api
    response = await client.chat.completions.create(model="tiny-tools", messages=MESSAGES, tools=[WEATHER_TOOL],
                                                    tool_choice="none")
    (choice,) = response.choices
    assert choice.finish_reason == "stop" and not choice.message.tool_calls
    assert "<tool_call>" in choice.message.content
    assert backend.prompts[-1].startswith("Tools: get_weather=")  # still described, as vLLM does
    backend.answer = PLAIN
    plain = await client.chat.completions.create(model="tiny-tools", messages=MESSAGES, tools=[WEATHER_TOOL])
    assert (plain.choices[0].finish_reason, plain.choices[0].message.content) == ("stop", "\n\nIt is sunny.")
    assert not plain.choices[0].message.tool_calls


async def test_earlier_calls_and_their_results_reach_the_template(api):
    client, backend = api
    backend.answer = PLAIN
    history = MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
    ]
    await client.chat.completions.create(model="tiny-tools", messages=history, tools=[WEATHER_TOOL])
    rendered = backend.prompts[-1]
    # the call's arguments reach the template as an object (its tojson writes them back)
    assert 'assistant: <tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>' in rendered
    assert "tool[call_1]: sunny, 21 C\n" in rendered


FORCED_LIST = ('Both.</think>\n\n[{"name": "get_weather", "parameters": {"city": "Paris"}}, '
               '{"name": "get_time", "parameters": {}}]')
FORCED_ARGUMENTS = 'Rome, then.</think>\n\n{"city": "Rome"}'


async def test_a_forced_choice_is_decoded_under_the_calls_schema_and_comes_back_as_calls(api):
    client, backend = api
    backend.answer = FORCED_LIST
    response = await client.chat.completions.create(model="tiny-tools", messages=MESSAGES,
                                                    tools=[WEATHER_TOOL, TIME_TOOL], tool_choice="required")
    (choice,) = response.choices
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert choice.message.reasoning_content == "Both."
    assert [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls] == [
        ("get_weather", {"city": "Paris"}), ("get_time", {})]
    # the workers decode the answer under a list of calls of the tools (what the scripted answer is)
    schema = json.loads(backend.specs[-1].sampling.structured_output.spec)
    jsonschema.validate(json.loads(FORCED_LIST.split("\n\n", 1)[1]), schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "get_weather", "parameters": {}}], schema)  # its parameters say city
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([], schema)
    backend.answer = FORCED_ARGUMENTS
    stream = await client.chat.completions.create(
        model="tiny-tools", messages=MESSAGES, tools=[WEATHER_TOOL, TIME_TOOL], stream=True,
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    content, calls, finish = await streamed(stream)
    assert (content, finish) == ("", "tool_calls")
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [("get_weather", {"city": "Rome"})]
    assert json.loads(backend.specs[-1].sampling.structured_output.spec) == WEATHER_TOOL["function"]["parameters"]
    await client.chat.completions.create(model="tiny-tools", messages=MESSAGES, tools=[WEATHER_TOOL, TIME_TOOL],
                                         tool_choice="required", parallel_tool_calls=False)
    assert json.loads(backend.specs[-1].sampling.structured_output.spec)["maxItems"] == 1


class Place(pydantic.BaseModel):
    city: str


class Trip(pydantic.BaseModel):
    start: Place
    stops: list[Place]


class Booking(pydantic.BaseModel):
    """Another tool whose $defs also name a "Place", a different one."""

    class Place(pydantic.BaseModel):
        seat: int

    place: Place


TRIP_TOOL = openai.pydantic_function_tool(Trip)  # parameters refer to "#/$defs/Place"
BOOKING_TOOL = openai.pydantic_function_tool(Booking, name="book")


def compiles_and_accepts(model: ServedModel, spec: str, answer: str) -> bool:
    """Whether a worker compiles `spec` (as its GrammarCompiler does) and the grammar takes `answer` whole."""
    compiled = GrammarCompiler(model.tokenizer, model.vocab_size, sorted(model.eos_token_ids)).compile(
        StructuredOutput.json_schema(spec))
    matcher = xgrammar.GrammarMatcher(compiled)
    return matcher.accept_string(answer) and matcher.is_completed()


async def test_a_forced_call_of_a_tool_with_defs_is_served(api, tool_model):
    client, backend = api
    tools = [TRIP_TOOL, BOOKING_TOOL]
    assert set(TRIP_TOOL["function"]["parameters"]["$defs"]) == set(BOOKING_TOOL["function"]["parameters"]["$defs"])
    trip = {"start": {"city": "Paris"}, "stops": [{"city": "Lyon"}]}
    backend.answer = "Trip.</think>\n\n" + json.dumps(trip)
    response = await client.chat.completions.create(model="tiny-tools", messages=MESSAGES, tools=tools,
                                                    tool_choice={"type": "function", "function": {"name": "Trip"}})
    (call,) = response.choices[0].message.tool_calls
    assert call.function.name == "Trip"
    jsonschema.validate(json.loads(call.function.arguments), TRIP_TOOL["function"]["parameters"])
    spec = backend.specs[-1].sampling.structured_output.spec
    assert compiles_and_accepts(tool_model, spec, json.dumps(trip))

    # "required": each tool's refs lead into its own branch, its own Place
    calls = [{"name": "Trip", "parameters": trip}, {"name": "book", "parameters": {"place": {"seat": 12}}}]
    backend.answer = "Both.</think>\n\n" + json.dumps(calls)
    response = await client.chat.completions.create(model="tiny-tools", messages=MESSAGES, tools=tools,
                                                    tool_choice="required")
    served = [(c.function.name, json.loads(c.function.arguments)) for c in response.choices[0].message.tool_calls]
    assert served == [("Trip", trip), ("book", {"place": {"seat": 12}})]
    jsonschema.validate(served[0][1], TRIP_TOOL["function"]["parameters"])
    jsonschema.validate(served[1][1], BOOKING_TOOL["function"]["parameters"])
    spec = backend.specs[-1].sampling.structured_output.spec
    assert compiles_and_accepts(tool_model, spec, json.dumps(calls))
    swapped = [{"name": "book", "parameters": {"place": {"city": "Paris"}}}]  # Trip's Place under book
    assert not compiles_and_accepts(tool_model, spec, json.dumps(swapped))
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(swapped, json.loads(spec))


async def test_a_forced_answer_the_token_limit_cut_stays_content(api):
    client, backend = api
    backend.answer = 'Short.</think>\n\n[{"name": "get_wea'
    backend.finish = common_pb2.FINISH_REASON_LENGTH
    response = await client.chat.completions.create(model="tiny-tools", messages=MESSAGES, tools=[WEATHER_TOOL],
                                                    tool_choice="required")
    (choice,) = response.choices
    assert choice.finish_reason == "length" and not choice.message.tool_calls
    assert choice.message.content == '\n\n[{"name": "get_wea'


@pytest.mark.parametrize("extra, param", [
    ({"tool_choice": {"type": "function", "function": {"name": "get_stock"}}}, "tool_choice.function.name"),
    ({"tool_choice": {"type": "retrieval"}}, "tool_choice.type"),
    ({"tool_choice": "required", "tools": []}, "tool_choice"),
    ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"tool_choice": "sometimes"}, "tool_choice"),
    ({"parallel_tool_calls": "no"}, "parallel_tool_calls"),
    ({"tools": [{"type": "function", "function": {"name": ""}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "retrieval"}]}, "tools[0].type"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]}, "tools[0].function.parameters"),
    ({"tools": [TIME_TOOL] * 129}, "tools"),
    ({"tools": {"name": "f"}}, "tools"),
    ({"messages": MESSAGES + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{not json"}}]}]},
     "messages[1].tool_calls[0].function.arguments"),
    ({"messages": MESSAGES + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "[" * 100_000 + "]" * 100_000}}]}]},
     "messages[1].tool_calls[0].function.arguments"),
    ({"messages": MESSAGES + [{"role": "tool", "content": "sunny"}]}, "messages[1].tool_call_id"),
    ({"messages": MESSAGES + [{"role": "user", "content": "x", "tool_call_id": "c"}]}, "messages[1].tool_call_id"),
    ({"messages": MESSAGES + [{"role": "assistant", "content": None}]}, "messages[1].content"),
])
async def test_what_cannot_be_honoured_is_a_400_naming_the_field(api, extra, param):
    client, _ = api
    body = {"tools": [WEATHER_TOOL], **extra}
    messages = body.pop("messages", MESSAGES)
    with pytest.raises(openai.BadRequestError) as raised:
        await client.chat.completions.create(model="tiny-tools", messages=messages, extra_body=body)
    assert raised.value.body["param"] == param


def test_a_template_without_a_tool_format_refuses_tools(model_dir):
    plain = ServedModel(ServedModelConfig(source=str(model_dir)))
    assert plain.tool_call_format is None
    with pytest.raises(InvalidArgument) as raised:
        plain.encode(Prompt(text="hi", tools=(WEATHER_TOOL,)))
    assert raised.value.field == "tools"


def test_inline_mode_keeps_the_model_text_whole(tool_model):
    assert tool_model.tool_call_format == "hermes"
    ids = tool_model.tokenizer.encode(TWO_CALLS, add_special_tokens=False)
    text = SampleText(0, tool_model.tokenizer, [1], SamplingParams(max_tokens=None), tool_model.eos_token_ids,
                      tool_model.reasoning, ReasoningMode.INLINE, tool_format="hermes")
    output = text.push(TokenDelta(0, tuple(ids), FinishReason.STOP))
    assert output is not None and output.text == TWO_CALLS and output.tool_calls == ()


# gpt-oss's way: a harmony message addressed to the function, after the analysis channel
HARMONY_TEMPLATE = (
    "{% for m in messages %}<|start|>{{ m.role }}<|message|>{{ m.content }}<|end|>{% endfor %}"
    "{% if tools %}<|start|>developer<|message|>{% for tool in tools %}{{ tool.function.name }} {% endfor %}"
    "(call as to=functions.NAME)<|end|>{% endif %}<|start|>assistant"
)
HARMONY_CALL = ("<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant<|channel|>commentary "
                'to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>')


@pytest.fixture(scope="module")
def harmony_tool_model(harmony_dir, tmp_path_factory) -> ServedModel:  # noqa: F811
    directory = tmp_path_factory.mktemp("harmony-tools")
    for path in harmony_dir.iterdir():
        shutil.copy(path, directory / path.name)
    tokenizer_config = json.loads((directory / "tokenizer_config.json").read_text())
    (directory / "tokenizer_config.json").write_text(json.dumps({**tokenizer_config,
                                                                 "chat_template": HARMONY_TEMPLATE}))
    return ServedModel(ServedModelConfig(source=str(directory), served_name="tiny-tools"))


@pytest.mark.parametrize("stream", [False, True])
async def test_a_harmony_message_to_a_function_is_a_call(harmony_tool_model, stream):
    assert harmony_tool_model.tool_call_format == "harmony"
    async with serving(harmony_tool_model) as (client, backend):
        backend.answer = HARMONY_CALL
        response = await client.chat.completions.create(model="tiny-tools", messages=MESSAGES, tools=[WEATHER_TOOL],
                                                        stream=stream)
        if stream:
            reasoning, content, calls, finish = "", "", [], None
            async for chunk in response:
                (choice,) = chunk.choices
                reasoning += getattr(choice.delta, "reasoning_content", None) or ""
                content += choice.delta.content or ""
                calls += choice.delta.tool_calls or []
                finish = choice.finish_reason or finish
        else:
            (choice,) = response.choices
            message = choice.message
            reasoning, content, calls, finish = (message.reasoning_content, message.content, message.tool_calls,
                                                 choice.finish_reason)
        assert (reasoning, content or None, finish) == ("Need the weather.", None, "tool_calls")
        assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [("get_weather", {"city": "Paris"})]
        assert "get_weather (call as to=functions.NAME)" in backend.prompts[-1]


# ---- the gRPC front door ------------------------------------------------------------------


@pytest.fixture
async def grpc_stub(tool_model):
    backend = ScriptedBackend(tool_model)
    server = await serve([registration(GatewayServicer(backend, [tool_model.config]))], "127.0.0.1:0",
                         handle_signals=False)
    try:
        await server.set_ready()
        async with aio_channel(server.address) as channel:
            yield gateway_pb2_grpc.GatewayStub(channel), backend
    finally:
        await server.drain(0)


def grpc_chat(**fields) -> gateway_pb2.GenerateRequest:  # type: ignore[no-untyped-def]
    chat = fields.pop("chat", [gateway_pb2.ChatMessage(role="user", content="Weather and time in Paris?")])
    return gateway_pb2.GenerateRequest(chat=gateway_pb2.ChatMessages(messages=chat), **fields)


GRPC_TOOLS = [gateway_pb2.Tool(name="get_weather", description="Weather in a city",
                               parameters_json=json.dumps(WEATHER_TOOL["function"]["parameters"])),
              gateway_pb2.Tool(name="get_time")]


async def test_grpc_forced_calls(grpc_stub):
    stub, backend = grpc_stub
    backend.answer = FORCED_LIST
    deltas = [d async for r in stub.Generate(grpc_chat(tools=GRPC_TOOLS, tool_choice=gateway_pb2.TOOL_CHOICE_REQUIRED))
              for d in r.samples]
    assert [(c.name, json.loads(c.arguments_json)) for d in deltas for c in d.tool_calls] == [
        ("get_weather", {"city": "Paris"}), ("get_time", {})]
    assert json.loads(backend.specs[-1].sampling.structured_output.spec)["type"] == "array"
    backend.answer = FORCED_ARGUMENTS
    deltas = [d async for r in stub.Generate(grpc_chat(tools=GRPC_TOOLS, tool_choice_function="get_weather"))
              for d in r.samples]
    assert [(c.name, json.loads(c.arguments_json)) for d in deltas for c in d.tool_calls] == [
        ("get_weather", {"city": "Rome"})]


async def test_grpc_calls_come_in_their_own_field(grpc_stub):
    stub, backend = grpc_stub
    calls, text, finish = [], "", None
    async for response in stub.Generate(grpc_chat(tools=GRPC_TOOLS)):
        for delta in response.samples:
            calls += delta.tool_calls
            text += delta.text
            finish = delta.finish_reason or finish
    assert [(c.name, json.loads(c.arguments_json)) for c in calls] == [("get_weather", {"city": "Paris"}),
                                                                        ("get_time", {})]
    assert all(c.id.startswith("call_") for c in calls) and len({c.id for c in calls}) == 2
    assert text == "\n\nLet me look.\n" and finish == common_pb2.FINISH_REASON_STOP
    assert backend.prompts[-1].startswith('Tools: get_weather={"type": "object"')
    none = [d async for r in stub.Generate(grpc_chat(tools=GRPC_TOOLS, tool_choice=gateway_pb2.TOOL_CHOICE_NONE))
            for d in r.samples]
    assert not any(d.tool_calls for d in none) and "<tool_call>" in "".join(d.text for d in none)
    history = [
        gateway_pb2.ChatMessage(role="user", content="Weather?"),
        gateway_pb2.ChatMessage(role="assistant", tool_calls=[
            gateway_pb2.ToolCall(id="call_1", name="get_weather", arguments_json='{"city": "Paris"}')]),
        gateway_pb2.ChatMessage(role="tool", tool_call_id="call_1", content="sunny"),
    ]
    async for _ in stub.Generate(grpc_chat(chat=history, tools=GRPC_TOOLS)):
        pass
    assert 'assistant: <tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>' in backend.prompts[-1]
    assert "tool[call_1]: sunny" in backend.prompts[-1]


@pytest.mark.parametrize("request_fields, field", [
    ({"tools": [gateway_pb2.Tool(name="")]}, "tools[0].name"),
    ({"tools": [gateway_pb2.Tool(name="f", parameters_json="[1]")]}, "tools[0].parameters_json"),
    ({"tools": [gateway_pb2.Tool(name="f", parameters_json="{")]}, "tools[0].parameters_json"),
    ({"tools": [gateway_pb2.Tool(name="f")] * 129}, "tools"),
    ({"tools": GRPC_TOOLS, "tool_choice": 7}, "tool_choice"),
    ({"tools": GRPC_TOOLS, "tool_choice_function": "get_stock"}, "tool_choice_function"),
    ({"tool_choice": gateway_pb2.TOOL_CHOICE_REQUIRED}, "tool_choice"),
    ({"tools": GRPC_TOOLS, "tool_choice": gateway_pb2.TOOL_CHOICE_REQUIRED,
      "sampling": common_pb2.SamplingParams(structured_output=common_pb2.StructuredOutput(json_object=True))},
     "sampling.structured_output"),
    ({"chat": [gateway_pb2.ChatMessage(role="user", content="x", tool_call_id="c")]},
     "chat.messages[0].tool_call_id"),
    ({"chat": [gateway_pb2.ChatMessage(role="tool", content="x")]}, "chat.messages[0].tool_call_id"),
    ({"chat": [gateway_pb2.ChatMessage(role="user", content="x", tool_calls=[gateway_pb2.ToolCall(name="f")])]},
     "chat.messages[0].tool_calls"),
    ({"chat": [gateway_pb2.ChatMessage(role="assistant", tool_calls=[
        gateway_pb2.ToolCall(name="f", arguments_json="nope")])]}, "chat.messages[0].tool_calls[0].arguments_json"),
])
async def test_grpc_tool_fields_are_checked_by_name(grpc_stub, request_fields, field):
    stub, _ = grpc_stub
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        async for _ in stub.Generate(grpc_chat(**request_fields)):
            pass
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in raised.value.details()


async def test_grpc_tools_need_templated_input(grpc_stub):
    stub, _ = grpc_stub
    for request in (gateway_pb2.GenerateRequest(text="hi", raw_prompt=True, tools=GRPC_TOOLS),
                    gateway_pb2.GenerateRequest(token_ids=gateway_pb2.TokenIds(ids=[1, 2]), tools=GRPC_TOOLS)):
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            async for _ in stub.Generate(request):
                pass
        assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "tools" in raised.value.details()
    async for _ in stub.Generate(gateway_pb2.GenerateRequest(text="Weather?", tools=GRPC_TOOLS)):  # text: templated
        pass


async def test_a_conversation_the_template_refuses_is_a_400_on_both_front_doors(api, grpc_stub):
    client, _ = api
    with pytest.raises(openai.BadRequestError) as raised:
        await client.chat.completions.create(model="tiny-tools", messages=MESSAGES + [{"role": "system", "content": "x"}])
    assert raised.value.body["param"] == "messages" and "must not end with a system turn" in raised.value.message
    stub, _ = grpc_stub
    with pytest.raises(grpc.aio.AioRpcError) as grpc_raised:
        async for _ in stub.Generate(grpc_chat(chat=[gateway_pb2.ChatMessage(role="system", content="x")])):
            pass
    assert grpc_raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "must not end with a system turn" in grpc_raised.value.details()
