"""Request priorities through the gateway: a non-zero `priority` is refused unless the gateway
takes priorities (`--scheduling-policy priority`); taken, it reaches the engines of both
workers a disaggregated request runs on (over HTTP and gRPC), and orders waiting requests: with
the one seat of a decode worker held, colocated or disaggregated (where requests whose KV
arrived wait for the seat holding it), a later request of a lower value runs before an earlier
one of a higher value; a key's priority floor raises its requests' more urgent or absent
priorities to the floor, over HTTP and gRPC, and leaves the other key's alone. (Priorities also order the admissions that wait for a disaggregated
decode worker's KV blocks: tests/services/decode.)"""

from __future__ import annotations

import asyncio
import contextlib

import grpc
import openai
import pytest
import pytest_asyncio

from cleave.api_keys import ApiKeys
from cleave.client import GatewayClient
from cleave.proto.cleave.v1 import gateway_pb2
from tests.services.gateway.stack import MODEL_NAME, start_stack
from tests.services.gateway.test_tenant_limits import until

TIMEOUT_S = 60.0  # a guard against a hang; every wait below ends on an event
IDS = gateway_pb2.StreamOptions(include_token_ids=True)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def fcfs_stack(model_dir):
    running = await start_stack(model_dir, "colocated")
    yield running
    await running.close()


@pytest_asyncio.fixture(scope="module", loop_scope="module", params=["colocated", "disaggregated"])
async def one_seat_stack(model_dir, request):
    """A gateway that takes priorities, over a decode worker that runs one request at a time
    (with a context long enough for a request that holds the seat far longer than needed)."""
    running = await start_stack(model_dir, request.param, priorities=True, max_num_seqs=1, max_model_len=1024)
    yield running
    await running.close()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def disaggregated_stack(model_dir):
    running = await start_stack(model_dir, "disaggregated", priorities=True)
    yield running
    await running.close()


@pytest.mark.asyncio(loop_scope="module")
async def test_a_priority_is_refused_naming_it_unless_the_gateway_takes_priorities(fcfs_stack):
    async with openai.AsyncOpenAI(base_url=fcfs_stack.http_url, api_key="none", max_retries=0) as client:
        with pytest.raises(openai.BadRequestError) as refused:
            await client.completions.create(model=MODEL_NAME, prompt="hi", max_tokens=1, extra_body={"priority": 3})
        assert refused.value.body["param"] == "priority"
        assert "--scheduling-policy priority" in refused.value.body["message"]
        plain = await client.completions.create(model=MODEL_NAME, prompt="hi", max_tokens=1, extra_body={"priority": 0})
        assert plain.choices[0].finish_reason == "length"
        with pytest.raises(openai.BadRequestError) as refused:
            await client.completions.create(model=MODEL_NAME, prompt="hi", max_tokens=1, extra_body={"priority": 1.5})
        assert refused.value.body["param"] == "priority"
    async with GatewayClient(fcfs_stack.gateway_address) as client:
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await client.complete("hi", max_tokens=1, priority=-1)
        assert refused.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert "sampling.priority" in refused.value.details()


async def _run(stream, name: str, order: list[str]) -> None:  # type: ignore[no-untyped-def]
    """Read the stream to its end, then note `name` (with a seat for one, a request that
    starts first ends first)."""
    async with contextlib.aclosing(stream) as chunks:
        tokens = [chunk async for chunk in chunks]
    assert sum(tokens) >= 1, name
    order.append(name)


async def _http_tokens(client: openai.AsyncOpenAI, priority: int):  # type: ignore[no-untyped-def]
    stream = await client.completions.create(model=MODEL_NAME, prompt="a short one", max_tokens=4, temperature=0.0,
                                             stream=True, extra_body={"priority": priority, "ignore_eos": True})
    async for chunk in stream:
        yield bool(chunk.choices and (chunk.choices[0].text or getattr(chunk.choices[0], "reasoning_content", None)))


@pytest.mark.asyncio(loop_scope="module")
async def test_a_later_request_of_a_lower_value_runs_first_when_the_seat_frees(one_seat_stack):
    stack = one_seat_stack
    decode = stack.decode[0]
    order: list[str] = []
    async with GatewayClient(stack.gateway_address) as client, \
            openai.AsyncOpenAI(base_url=stack.http_url, api_key="none", max_retries=0) as http:
        # gRPC; cancelled below once both others wait (1000 steps: far longer than that takes)
        holder = client.generate("hold the seat", max_tokens=1000, temperature=0.0, ignore_eos=True, stream=IDS)
        while not any(sample.token_ids for sample in (await holder.read()).samples):
            pass  # the one seat is taken once tokens flow
        try:
            await until(lambda: decode.engine.scheduler.num_running == 1, TIMEOUT_S)
            later, sooner = _http_tokens(http, 5), _http_tokens(http, -5)
            waits = [asyncio.ensure_future(_run(later, "priority 5", order))]
            await until(lambda: decode.engine.scheduler.num_waiting_for_seat == 1, TIMEOUT_S)
            waits.append(asyncio.ensure_future(_run(sooner, "priority -5", order)))
            await until(lambda: decode.engine.scheduler.num_waiting_for_seat == 2, TIMEOUT_S)
            load = decode.load()
            assert (load.num_running, load.num_waiting) == (1, 2)  # the seat's bound holds
            assert order == []
        finally:
            holder.cancel()  # the gateway aborts it on its worker, and the seat frees
        await asyncio.wait_for(asyncio.gather(*waits), TIMEOUT_S)
    assert order == ["priority -5", "priority 5"]


@pytest.mark.asyncio(loop_scope="module")
async def test_a_disaggregated_requests_priority_reaches_the_prefill_and_the_decode_engine(disaggregated_stack,
                                                                                          monkeypatch):
    stack = disaggregated_stack
    built: list[tuple[str, str, int]] = []  # (worker, request id, its samples' priority) per request built
    for backend in stack.prefill + stack.decode:
        prepare = backend.engine.prepare_request

        def recording(*args, _prepare=prepare, _worker=backend.worker_id, **kwargs):  # type: ignore[no-untyped-def]
            state = _prepare(*args, **kwargs)
            built.append((_worker, state.request_id, state.samples[0].seq.priority))
            return state

        monkeypatch.setattr(backend.engine, "prepare_request", recording)
    async with GatewayClient(stack.gateway_address) as client, \
            openai.AsyncOpenAI(base_url=stack.http_url, api_key="none", max_retries=0) as http:
        await http.completions.create(model=MODEL_NAME, prompt="over http", max_tokens=3, extra_body={"priority": 7})
        await client.complete("over grpc", max_tokens=3, priority=-7)
    # (the decode worker builds a request twice: to validate it at Admit, and to run it)
    assert {(worker, priority) for worker, _, priority in built} == {
        ("decode-0", -7), ("decode-0", 7), ("prefill-0", -7), ("prefill-0", 7)}


FLOORED, FREE = "sk-batch", "sk-interactive"


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def floored_stack(model_dir):
    """A gateway taking priorities with two keys, the first with a priority floor of 5."""
    running = await start_stack(model_dir, "colocated", priorities=True,
                                api_key=ApiKeys((FLOORED, FREE), priority_floors={FLOORED: 5}))
    yield running
    await running.close()


@pytest.mark.asyncio(loop_scope="module")
async def test_a_keys_priority_floor_raises_its_more_urgent_or_absent_priorities(floored_stack, monkeypatch):
    stack = floored_stack
    backend = stack.decode[0]
    built: list[tuple[str, int]] = []  # (prompt, its samples' priority) per request the engine built
    prepare = backend.engine.prepare_request

    def recording(*args, **kwargs):  # type: ignore[no-untyped-def]
        state = prepare(*args, **kwargs)
        built.append(state.samples[0].seq.priority)
        return state

    monkeypatch.setattr(backend.engine, "prepare_request", recording)
    asked: list[int | None] = [-5, None, 9]
    for key in (FLOORED, FREE):
        async with openai.AsyncOpenAI(base_url=stack.http_url, api_key=key, max_retries=0) as http:
            for priority in asked:
                extra = {} if priority is None else {"priority": priority}
                await http.completions.create(model=MODEL_NAME, prompt="floored", max_tokens=1, extra_body=extra)
        async with GatewayClient(stack.gateway_address, api_key=key) as client:
            for priority in asked:
                await client.complete("floored", max_tokens=1, priority=priority or 0)
    assert built == [5, 5, 9] * 2 + [-5, 0, 9] * 2
