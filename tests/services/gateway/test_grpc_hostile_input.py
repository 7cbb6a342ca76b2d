"""Hostile gRPC input found by probing the gateway field by field: each case is refused with
INVALID_ARGUMENT naming the field, before its cost is paid, and the stack serves afterwards
with its decode pools full again."""

from __future__ import annotations

import asyncio
import json
import threading

import grpc
import pytest
import pytest_asyncio
from grpc_health.v1 import health_pb2, health_pb2_grpc

from cleave.generation.sampling_params import MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS
from cleave.proto.cleave.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from cleave.rpc import aio_channel, serve
from cleave.rpc.errors import error_detail
from services.gateway.__main__ import registration
from services.gateway.router import INLINE_TOKENIZE_MAX_BYTES, GatewayOptions, RoutingBackend
from services.gateway.servicer import GatewayServicer
from tests.services.gateway.helpers import assert_decode_pools_full
from tests.services.gateway.stack import MAX_MODEL_LEN, start_stack
from tests.services.gateway.test_tool_calls import tool_model  # noqa: F401  (a fixture)

pytestmark = pytest.mark.asyncio(loop_scope="module")
g = gateway_pb2
MANY = 100_000


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def stack(model_dir):
    running = await start_stack(model_dir, "disaggregated")
    yield running
    await running.close()


@pytest_asyncio.fixture(loop_scope="module")
async def gateway(stack):
    async with aio_channel(stack.gateway_address) as channel:
        yield gateway_pb2_grpc.GatewayStub(channel)
    await assert_decode_pools_full(stack)


async def finish_reasons(gateway, request: gateway_pb2.GenerateRequest) -> list[int]:  # type: ignore[no-untyped-def]
    return [sample.finish_reason async for response in gateway.Generate(request, timeout=30)
            for sample in response.samples if sample.finish_reason]


async def refused_field(gateway, request: gateway_pb2.GenerateRequest) -> str:  # type: ignore[no-untyped-def]
    """The field an INVALID_ARGUMENT refusal of `request` names."""
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await finish_reasons(gateway, request)
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT, raised.value.details()
    detail = error_detail(raised.value)
    assert detail is not None and raised.value.details().startswith(f"{detail.field}: ")
    return detail.field


async def test_stop_token_ids_are_bounded(gateway):
    # unbounded, a 30 MB list of them held each worker's event loop past its health checks
    at_limit = common_pb2.SamplingParams(max_tokens=2, stop_token_ids=[3] * MAX_STOP_TOKEN_IDS)
    assert len(await finish_reasons(gateway, gateway_pb2.GenerateRequest(text="Hi", sampling=at_limit))) == 1
    over = common_pb2.SamplingParams(max_tokens=2, stop_token_ids=[3] * (MAX_STOP_TOKEN_IDS + 1))
    request = gateway_pb2.GenerateRequest(text="Hi", sampling=over)
    assert await refused_field(gateway, request) == "sampling.stop_token_ids"


# Each list is too long and its first element is bad too: the field named shows that the length
# was checked first, before the elements were converted one by one on the gateway's event loop
# (32 MB of them held every other stream for up to 35 s).
TOO_LONG = {
    "prompt token ids": (g.GenerateRequest(token_ids=g.TokenIds(ids=[2**32 - 1] + [5] * MANY)), "input"),
    "chat turns": (g.GenerateRequest(chat=g.ChatMessages(messages=[g.ChatMessage(role="nobody")] * MANY)),
                   "chat.messages"),
    "earlier tool calls": (g.GenerateRequest(chat=g.ChatMessages(messages=[
        g.ChatMessage(role="assistant", tool_calls=[g.ToolCall(name="")] * MAX_MODEL_LEN),
        g.ChatMessage(role="user", content="Hi")])), "chat.messages[0].tool_calls"),
    "stop strings": (g.GenerateRequest(text="Hi", sampling=common_pb2.SamplingParams(stop=[""] + ["x"] * MANY)),
                     "sampling.stop"),
    "stop token ids": (g.GenerateRequest(text="Hi", sampling=common_pb2.SamplingParams(
        stop_token_ids=[2**32 - 1] + [3] * MANY)), "sampling.stop_token_ids"),
}


@pytest.mark.parametrize(("request_", "field"), TOO_LONG.values(), ids=TOO_LONG.keys())
async def test_a_list_too_long_is_refused_before_its_elements_are_read(gateway, request_, field):
    assert await refused_field(gateway, request_) == field


async def test_with_truncation_token_ids_past_the_context_are_read_from_their_end(gateway):
    # the raw count is bounded by the message size alone; only the last context's worth is
    # read (no truncation keeps more), so an out-of-range id before it is never converted
    one_token = common_pb2.SamplingParams(max_tokens=1)
    long_ids = [2**32 - 1] + [5] * MANY + [7] * MAX_MODEL_LEN
    served = g.GenerateRequest(token_ids=g.TokenIds(ids=long_ids), truncate_prompt_tokens=8, sampling=one_token)
    assert len(await finish_reasons(gateway, served)) == 1
    # one in what is read is refused at its place in the field
    bad_end = g.GenerateRequest(token_ids=g.TokenIds(ids=[5] * MANY + [2**32 - 1]), truncate_prompt_tokens=8)
    assert await refused_field(gateway, bad_end) == f"token_ids.ids[{MANY}]"
    # turns keep their bound: each renders to a token at least, so all but the last context's
    # worth would be cut whole
    turns = g.GenerateRequest(chat=g.ChatMessages(messages=[g.ChatMessage(role="user")] * MAX_MODEL_LEN),
                              truncate_prompt_tokens=8, sampling=one_token)
    assert await refused_field(gateway, turns) == "chat.messages"


async def test_prompts_within_the_limits_are_served(gateway):
    filling = g.GenerateRequest(token_ids=g.TokenIds(ids=[5] * (MAX_MODEL_LEN - 1)),
                                sampling=common_pb2.SamplingParams(max_tokens=1))
    turns = [g.ChatMessage(role="user", content="Hi"), g.ChatMessage(role="assistant", tool_calls=[g.ToolCall(name="f")]),
             g.ChatMessage(role="tool", content="1", tool_call_id="call-1")]
    conversation = g.GenerateRequest(chat=g.ChatMessages(messages=turns), sampling=common_pb2.SamplingParams(
        max_tokens=2, stop=["x"] * MAX_STOP_STRINGS))
    for request in (filling, conversation):
        assert len(await finish_reasons(gateway, request)) == 1


async def test_min_tokens_past_the_context_is_refused(gateway):
    # without max_tokens the sample would end at the context, short of its min_tokens
    sampling = common_pb2.SamplingParams(min_tokens=MAX_MODEL_LEN)
    assert await refused_field(gateway, g.GenerateRequest(text="Hi", sampling=sampling)) == "sampling.min_tokens"


@pytest_asyncio.fixture(loop_scope="module")
async def tools_gateway(tool_model):  # noqa: F811
    """A gateway over the tools model whose workers never answer: a request ends once tokenized."""
    unreachable = "127.0.0.1:9"  # discard port
    backend = RoutingBackend(tool_model, [unreachable], [unreachable], GatewayOptions(mode="disaggregated"))
    server = await serve([registration(GatewayServicer(backend, [tool_model.config]))], "127.0.0.1:0",
                         handle_signals=False)
    try:
        await server.set_ready()
        async with aio_channel(server.address) as channel:
            yield channel
    finally:
        await server.drain(0)
        await backend.shutdown()


def with_tool(description: str) -> gateway_pb2.GenerateRequest:
    """A short turn and one tool described at length."""
    schema = {"type": "object", "properties": {"city": {"type": "string", "description": description}}}
    return g.GenerateRequest(chat=g.ChatMessages(messages=[g.ChatMessage(role="user", content="Hi")]),
                             tools=[g.Tool(name="get_weather", parameters_json=json.dumps(schema))])


async def test_a_short_turn_with_long_tool_schemas_renders_off_the_event_loop(tool_model, tools_gateway,  # noqa: F811
                                                                               monkeypatch):
    # the content alone is short, and was rendered and tokenized on the event loop: 25 MB of
    # tool schemas held every other stream there for 10 s
    encode = tool_model.tokenizer.encode_without_gil
    tokenizing, health_answered = threading.Event(), threading.Event()
    answered_while_tokenizing = []

    def held_encode(text: str, add_special_tokens: bool = True) -> list[int]:
        tokenizing.set()  # on the event loop, the health check below could not be answered
        answered_while_tokenizing.append(health_answered.wait(timeout=5))
        return encode(text, add_special_tokens=add_special_tokens)

    monkeypatch.setattr(tool_model.tokenizer, "encode_without_gil", held_encode)
    request = with_tool("x" * INLINE_TOKENIZE_MAX_BYTES)
    generating = asyncio.ensure_future(finish_reasons(gateway_pb2_grpc.GatewayStub(tools_gateway), request))
    try:
        assert await asyncio.to_thread(tokenizing.wait, 5)
        health = await health_pb2_grpc.HealthStub(tools_gateway).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        health_answered.set()
        with pytest.raises(grpc.aio.AioRpcError) as raised:  # too long for the context, or no worker
            await generating
    finally:
        health_answered.set()
        generating.cancel()
    assert raised.value.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.UNAVAILABLE)
    assert answered_while_tokenizing == [True]


async def test_tools_rendering_past_the_byte_bound_are_refused_before_tokenizing(tool_model, tools_gateway,  # noqa: F811
                                                                                 monkeypatch):
    # tokenizing 25 MB of rendered tool schemas took 8 s of one of the gateway's few tokenizer
    # threads, only to find the prompt too long
    encoded = []
    encode = tool_model.tokenizer.encode_without_gil
    monkeypatch.setattr(tool_model.tokenizer, "encode_without_gil",
                        lambda text, add_special_tokens=True: encoded.append(text) or encode(text, add_special_tokens))
    stub = gateway_pb2_grpc.GatewayStub(tools_gateway)
    assert await refused_field(stub, with_tool("x" * tool_model.max_prompt_bytes)) == "input"
    assert encoded == []
