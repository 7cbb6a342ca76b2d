"""Trace context across real grpc.aio servers: the interceptor's server spans, the client
interceptors of `aio_channel`, and refusing a malformed traceparent."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from opentelemetry import trace
from opentelemetry.trace import SpanKind, StatusCode

from cleave import errors
from cleave.proto.cleave.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from cleave.rpc import ServiceRegistration, aio_channel, error_detail, serve
from cleave.tracing import TRACING_OFF, Tracing, current_context, span
from tests.tracing.helpers import by_name, memory_tracing, traced_caller

VALID = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


class Downstream(gateway_pb2_grpc.GatewayServicer):
    """Records the metadata and current span of each call; Generate streams two messages,
    the second once `proceed` is set."""

    def __init__(self) -> None:
        self.metadata: list[dict[str, str]] = []
        self.error: BaseException | None = None
        self.proceed = asyncio.Event()
        self.proceed.set()

    async def Abort(self, request, context):
        self.metadata.append(dict(context.invocation_metadata()))
        with span("downstream.work"):
            pass
        return common_pb2.AbortResponse(found=current_context() is not None)

    async def Generate(self, request, context):
        yield gateway_pb2.GenerateResponse(request_id="one")
        await self.proceed.wait()
        yield gateway_pb2.GenerateResponse(request_id="two")
        if self.error is not None:
            raise self.error


class Upstream(gateway_pb2_grpc.GatewayServicer):
    """Abort calls the downstream server's Abort, as the gateway calls its workers."""

    def __init__(self, downstream_address: str) -> None:
        self.channel = aio_channel(downstream_address)

    async def Abort(self, request, context):
        return await gateway_pb2_grpc.GatewayStub(self.channel).Abort(request)


def registration(servicer) -> ServiceRegistration:  # type: ignore[no-untyped-def]
    return ServiceRegistration("cleave.v1.Gateway", servicer, gateway_pb2_grpc.add_GatewayServicer_to_server)


async def start(servicer, tracing: Tracing = TRACING_OFF):  # type: ignore[no-untyped-def]
    return await serve([registration(servicer)], "127.0.0.1:0", handle_signals=False, tracing=tracing)


async def test_a_call_chain_is_one_trace_across_two_servers():
    client_tracing, client_spans = memory_tracing("test-client")
    up_tracing, up_spans = memory_tracing("cleave-gateway")
    down_tracing, down_spans = memory_tracing("cleave-decode")
    downstream = Downstream()
    down_server = await start(downstream, down_tracing)
    upstream = Upstream(down_server.address)
    up_server = await start(upstream, up_tracing)
    try:
        async with aio_channel(up_server.address) as channel:
            with traced_caller(client_tracing, "client.request") as client_span:
                response = await gateway_pb2_grpc.GatewayStub(channel).Abort(
                    common_pb2.AbortRequest(request_id="r"), metadata=(("x-request-id", "rid-5"),))
    finally:
        await upstream.channel.close()
        await up_server.drain(0)
        await down_server.drain(0)
    assert response.found  # the downstream handler ran inside a traced context
    client = client_span.get_span_context()
    up = by_name(up_spans.get_finished_spans(), "cleave.v1.Gateway/Abort")
    down = by_name(down_spans.get_finished_spans(), "cleave.v1.Gateway/Abort")
    work = by_name(down_spans.get_finished_spans(), "downstream.work")
    assert up.context.trace_id == down.context.trace_id == work.context.trace_id == client.trace_id
    assert up.parent.span_id == client.span_id and up.parent.is_remote
    assert down.parent.span_id == up.context.span_id
    assert work.parent.span_id == down.context.span_id
    assert up.kind is SpanKind.SERVER and down.kind is SpanKind.SERVER
    assert up.attributes["request_id"] == "rid-5"
    assert up.attributes["rpc.grpc.status_code"] == "OK" and up.status.status_code is StatusCode.UNSET
    assert downstream.metadata[0]["traceparent"].split("-")[2] == format(up.context.span_id, "016x")
    assert len(client_spans.get_finished_spans()) == 1


async def test_calls_outside_a_traced_request_carry_no_traceparent():
    downstream = Downstream()
    server = await start(downstream)  # tracing off
    try:
        async with aio_channel(server.address) as channel:
            response = await gateway_pb2_grpc.GatewayStub(channel).Abort(common_pb2.AbortRequest(request_id="r"))
    finally:
        await server.drain(0)
    assert not response.found  # no tracer in the handler's context either
    assert "traceparent" not in downstream.metadata[0]


async def test_a_caller_traceparent_is_kept_and_parents_the_server_span():
    tracing, spans = memory_tracing("cleave-decode")
    downstream = Downstream()
    server = await start(downstream, tracing)
    try:
        async with aio_channel(server.address) as channel:
            await gateway_pb2_grpc.GatewayStub(channel).Abort(
                common_pb2.AbortRequest(request_id="r"), metadata=(("traceparent", VALID),))
    finally:
        await server.drain(0)
    (server_span,) = [s for s in spans.get_finished_spans() if s.kind is SpanKind.SERVER]
    assert format(server_span.context.trace_id, "032x") == VALID.split("-")[1]
    assert format(server_span.parent.span_id, "016x") == VALID.split("-")[2]


@pytest.mark.parametrize("traced", [True, False])
async def test_a_malformed_traceparent_is_invalid_argument_naming_it(traced):
    tracing, spans = memory_tracing("cleave-decode") if traced else (TRACING_OFF, None)
    downstream = Downstream()
    server = await start(downstream, tracing)
    try:
        async with aio_channel(server.address) as channel:
            stub = gateway_pb2_grpc.GatewayStub(channel)
            with pytest.raises(grpc.aio.AioRpcError) as raised:
                await stub.Abort(common_pb2.AbortRequest(request_id="r"),
                                 metadata=(("traceparent", "00-not-a-trace"), ("x-request-id", "rid-3")))
            with pytest.raises(grpc.aio.AioRpcError) as streamed:
                async for _ in stub.Generate(gateway_pb2.GenerateRequest(), metadata=(("traceparent", "bogus"),)):
                    pass
    finally:
        await server.drain(0)
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert raised.value.details().startswith("traceparent: the value '00-not-a-trace' does not parse")
    detail = error_detail(raised.value)
    assert (detail.field, detail.request_id) == ("traceparent", "rid-3")
    assert streamed.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "traceparent" in streamed.value.details()
    assert downstream.metadata == []  # the handlers never ran
    if spans is not None:
        assert spans.get_finished_spans() == ()


async def test_a_stream_span_ends_with_the_stream_and_its_status():
    tracing, spans = memory_tracing("cleave-gateway")
    downstream = Downstream()
    server = await start(downstream, tracing)
    try:
        async with aio_channel(server.address) as channel:
            stub = gateway_pb2_grpc.GatewayStub(channel)
            downstream.proceed.clear()
            call = stub.Generate(gateway_pb2.GenerateRequest())
            assert (await call.read()).request_id == "one"
            assert spans.get_finished_spans() == ()  # still streaming
            downstream.proceed.set()
            assert [r.request_id async for r in call] == ["two"]
            await call.code()
            for error in (errors.Unavailable("the engine shut down"), errors.ResourceExhausted("no free KV blocks")):
                downstream.error = error
                with pytest.raises(grpc.aio.AioRpcError):
                    async for _ in stub.Generate(gateway_pb2.GenerateRequest()):
                        pass
            # health polls make no spans
            await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
    finally:
        await server.drain(0)
    ok, failed, refused = spans.get_finished_spans()
    assert ok.name == failed.name == refused.name == "cleave.v1.Gateway/Generate"
    assert ok.attributes["rpc.grpc.status_code"] == "OK" and ok.status.status_code is StatusCode.UNSET
    assert failed.attributes["rpc.grpc.status_code"] == "UNAVAILABLE"
    assert failed.status.status_code is StatusCode.ERROR  # the server's fault
    assert refused.attributes["rpc.grpc.status_code"] == "RESOURCE_EXHAUSTED"
    assert refused.status.status_code is StatusCode.UNSET  # an answer to the caller, not a fault
    assert trace.get_current_span() is trace.INVALID_SPAN  # nothing leaked into the test's context
