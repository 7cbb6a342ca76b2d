"""The metrics interceptor counts every call with the status code its caller got."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from prometheus_client import CollectorRegistry

from cleave import errors
from cleave.metrics.grpc_server import GrpcServerMetrics
from cleave.metrics.labels import MetricLabels
from cleave.proto.cleave.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from cleave.rpc import ServiceRegistration, aio_channel, serve
from cleave.rpc.auth import api_key_auth
from cleave.rpc.metrics_interceptor import MetricsInterceptor
from tests.rpc.test_interceptor import ScriptedServicer

LABELS = MetricLabels("tiny", "gw-0")


@pytest.fixture
async def running():
    registry = CollectorRegistry()
    servicer = ScriptedServicer()
    registration = ServiceRegistration("cleave.v1.Gateway", servicer, gateway_pb2_grpc.add_GatewayServicer_to_server)
    server = await serve([registration], "127.0.0.1:0", handle_signals=False, auth=api_key_auth("k"),
                         metrics_interceptor=MetricsInterceptor(GrpcServerMetrics(registry, LABELS)))
    channel = aio_channel(server.address, api_key="k")
    yield servicer, gateway_pb2_grpc.GatewayStub(channel), registry, server.address
    await channel.close()
    await server.drain(0)


def handled(registry: CollectorRegistry, method: str, code: str) -> float:
    value = registry.get_sample_value("cleave:grpc_server_handled_total", {
        **LABELS.as_dict(), "grpc_service": "cleave.v1.Gateway", "grpc_method": method, "grpc_code": code})
    return value or 0.0


def timed(registry: CollectorRegistry, method: str) -> float:
    value = registry.get_sample_value("cleave:grpc_server_handling_seconds_count", {
        **LABELS.as_dict(), "grpc_service": "cleave.v1.Gateway", "grpc_method": method})
    return value or 0.0


async def test_each_call_counts_once_under_the_code_the_caller_got(running):
    servicer, stub, registry, address = running
    await stub.Abort(common_pb2.AbortRequest(request_id="r"))
    await stub.Abort(common_pb2.AbortRequest(request_id="r"))
    servicer.error = errors.NotFound("no such request", field="request_id")  # mapped by RequestInterceptor
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await stub.Abort(common_pb2.AbortRequest(request_id="r"))
    assert raised.value.code() == grpc.StatusCode.NOT_FOUND
    with pytest.raises(grpc.aio.AioRpcError):  # the servicer aborts with its own code
        await stub.ListModels(gateway_pb2.ListModelsRequest())
    async with aio_channel(address) as keyless:  # refused before the handler runs
        with pytest.raises(grpc.aio.AioRpcError):
            await gateway_pb2_grpc.GatewayStub(keyless).Abort(common_pb2.AbortRequest(request_id="r"))
    assert handled(registry, "Abort", "OK") == 2
    assert handled(registry, "Abort", "NOT_FOUND") == 1
    assert handled(registry, "Abort", "UNAUTHENTICATED") == 1
    assert handled(registry, "ListModels", "PERMISSION_DENIED") == 1
    assert timed(registry, "Abort") == 4


async def test_a_stream_counts_when_it_ends(running):
    servicer, stub, registry, _ = running
    responses = [response async for response in stub.Generate(gateway_pb2.GenerateRequest(text="x"))]
    assert len(responses) == 1 and handled(registry, "Generate", "OK") == 1
    servicer.error = errors.ResourceExhausted("full")
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        async for _ in stub.Generate(gateway_pb2.GenerateRequest(text="x")):
            pass
    assert raised.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    for _ in range(100):  # the server finishes its side after the client saw the status
        if handled(registry, "Generate", "RESOURCE_EXHAUSTED") == 1:
            break
        await asyncio.sleep(0.01)
    assert handled(registry, "Generate", "RESOURCE_EXHAUSTED") == 1
    assert timed(registry, "Generate") == 2


class HeldStreamServicer(gateway_pb2_grpc.GatewayServicer):
    """Generate returns an endless response generator and keeps a reference to it, so
    garbage collection never ends it: only the interceptors' closing does."""

    def __init__(self) -> None:
        self.streams: list = []
        self.closed = asyncio.Event()

    def Generate(self, request, context):
        stream = self._responses()
        self.streams.append(stream)
        return stream

    async def _responses(self):
        try:
            while True:
                yield gateway_pb2.GenerateResponse(request_id="tick")
                await asyncio.sleep(0)
        finally:
            self.closed.set()


async def test_a_cancelled_stream_closes_the_handlers_generator_through_both_interceptors():
    """The client cancels after two messages: the handler's generator is closed (its finally
    runs) by the request and metrics interceptors wrapping it, though the servicer still holds
    it (without the closing, it would end only if garbage collected)."""
    registry = CollectorRegistry()
    servicer = HeldStreamServicer()
    registration = ServiceRegistration("cleave.v1.Gateway", servicer, gateway_pb2_grpc.add_GatewayServicer_to_server)
    server = await serve([registration], "127.0.0.1:0", handle_signals=False,
                         metrics_interceptor=MetricsInterceptor(GrpcServerMetrics(registry, LABELS)))
    channel = aio_channel(server.address)
    try:
        call = gateway_pb2_grpc.GatewayStub(channel).Generate(gateway_pb2.GenerateRequest(text="hi"))
        assert [(await call.read()).request_id for _ in range(2)] == ["tick", "tick"]
        call.cancel()
        await asyncio.wait_for(servicer.closed.wait(), timeout=30)
        assert servicer.streams[0].ag_frame is None  # finished, not suspended
    finally:
        await channel.close()
        await server.drain(0)
