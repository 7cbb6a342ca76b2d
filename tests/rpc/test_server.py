"""serve(): health states, reflection, port binding and draining with in-flight calls."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from cleave.config import RpcConfig
from cleave.proto.cleave.v1 import common_pb2, gateway_pb2_grpc
from cleave.rpc import ServiceRegistration, aio_channel, serve

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
GATEWAY = "cleave.v1.Gateway"


class SlowAbortServicer(gateway_pb2_grpc.GatewayServicer):
    """Abort takes `delay_s`, long enough to be in flight while the server drains."""

    def __init__(self, delay_s: float) -> None:
        self.delay_s = delay_s
        self.entered = asyncio.Event()

    async def Abort(self, request, context):
        self.entered.set()
        await asyncio.sleep(self.delay_s)
        return common_pb2.AbortResponse(found=request.request_id == "known")


async def start(servicer, **kwargs):
    registration = ServiceRegistration(GATEWAY, servicer, gateway_pb2_grpc.add_GatewayServicer_to_server)
    return await serve([registration], "127.0.0.1:0", handle_signals=False, **kwargs)


async def health_status(channel, service: str) -> int:
    stub = health_pb2_grpc.HealthStub(channel)
    return (await stub.Check(health_pb2.HealthCheckRequest(service=service))).status


async def test_health_is_not_serving_until_ready_then_serving():
    server = await start(SlowAbortServicer(0))
    assert server.port > 0 and server.address == f"127.0.0.1:{server.port}"
    async with aio_channel(server.address) as channel:
        assert await health_status(channel, GATEWAY) == NOT_SERVING
        assert await health_status(channel, "") == NOT_SERVING
        await server.set_ready()
        assert await health_status(channel, GATEWAY) == SERVING
        assert await health_status(channel, "") == SERVING
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await health_status(channel, "cleave.v1.NoSuchService")
        assert error.value.code() == grpc.StatusCode.NOT_FOUND
    await server.drain(0)


async def test_reflection_lists_services():
    server = await start(SlowAbortServicer(0))
    async with aio_channel(server.address) as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        request = reflection_pb2.ServerReflectionRequest(list_services="")
        responses = [r async for r in stub.ServerReflectionInfo(iter([request]))]
    names = {s.name for s in responses[0].list_services_response.service}
    assert names == {GATEWAY, "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"}
    await server.drain(0)


async def test_reflection_can_be_disabled():
    server = await start(SlowAbortServicer(0), config=RpcConfig(reflection=False))
    async with aio_channel(server.address) as channel:
        # The call writes nothing: the server ends an unknown method at its headers, and a
        # request message racing that end fails on the client as INTERNAL, not as the status.
        call = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(timeout=30)
        assert await call.code() == grpc.StatusCode.UNIMPLEMENTED
    await server.drain(0)


async def test_drain_finishes_in_flight_calls_and_refuses_new_ones():
    servicer = SlowAbortServicer(delay_s=0.5)
    server = await start(servicer)
    await server.set_ready()
    async with aio_channel(server.address) as channel:
        watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service=""))
        assert (await watch.read()).status == SERVING
        stub = gateway_pb2_grpc.GatewayStub(channel)
        in_flight = asyncio.ensure_future(stub.Abort(common_pb2.AbortRequest(request_id="known")))
        await servicer.entered.wait()
        drain = asyncio.ensure_future(server.drain(grace_seconds=5))
        assert (await watch.read()).status == NOT_SERVING
        watch.cancel()  # an open Watch stream is in flight too and would hold the grace period
        response = await in_flight
        assert response.found is True
        await drain
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await stub.Abort(common_pb2.AbortRequest(request_id="known"), timeout=2)
        assert error.value.code() == grpc.StatusCode.UNAVAILABLE
    await asyncio.wait_for(server.wait(), timeout=2)


async def test_drain_cancels_calls_that_outlive_the_grace_period():
    servicer = SlowAbortServicer(delay_s=30)
    server = await start(servicer)
    async with aio_channel(server.address) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        in_flight = asyncio.ensure_future(stub.Abort(common_pb2.AbortRequest(request_id="known")))
        await servicer.entered.wait()
        await asyncio.wait_for(server.drain(grace_seconds=0.2), timeout=5)
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await in_flight
        assert error.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)


async def test_binding_a_used_port_fails_with_a_clear_error():
    server = await start(SlowAbortServicer(0))
    registration = ServiceRegistration(
        GATEWAY, SlowAbortServicer(0), gateway_pb2_grpc.add_GatewayServicer_to_server
    )
    with pytest.raises(OSError, match=f"cannot listen on 127.0.0.1:{server.port}"):
        await serve([registration], f"127.0.0.1:{server.port}", handle_signals=False)
    await server.drain(0)


async def test_replicas_that_share_the_port_both_bind_it():
    first = await start(SlowAbortServicer(0), config=RpcConfig(share_port=True))
    registration = ServiceRegistration(
        GATEWAY, SlowAbortServicer(0), gateway_pb2_grpc.add_GatewayServicer_to_server
    )
    second = await serve([registration], f"127.0.0.1:{first.port}", RpcConfig(share_port=True), handle_signals=False)
    try:
        assert second.port == first.port
        await first.drain(0)  # the port keeps answering through the second replica
        async with aio_channel(f"127.0.0.1:{first.port}") as channel:
            response = await gateway_pb2_grpc.GatewayStub(channel).Abort(common_pb2.AbortRequest(request_id="known"))
        assert response.found
    finally:
        await second.drain(0)


async def test_bad_listen_address_is_rejected():
    with pytest.raises(ValueError, match="host:port"):
        await serve([], "no-port-here", handle_signals=False)


async def test_message_size_limit_is_applied():
    server = await start(SlowAbortServicer(0), config=RpcConfig(max_message_bytes=1024))
    async with aio_channel(server.address) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await stub.Abort(common_pb2.AbortRequest(request_id="x" * 4096))
        assert error.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert (await stub.Abort(common_pb2.AbortRequest(request_id="known"))).found
    await server.drain(0)


class FlagReadiness:
    """A `Readiness` a test flips by hand."""

    def __init__(self, is_ready: bool) -> None:
        self.is_ready = is_ready
        self._watchers = []

    def watch(self, on_change) -> None:
        self._watchers.append(on_change)

    async def set(self, is_ready: bool) -> None:
        self.is_ready = is_ready
        for on_change in self._watchers:
            await on_change(is_ready)


async def test_health_follows_readiness_and_draining_wins():
    server = await start(SlowAbortServicer(0))
    readiness = FlagReadiness(False)
    async with aio_channel(server.address) as channel:
        await server.follow(readiness)
        assert [await health_status(channel, name) for name in (GATEWAY, "")] == [NOT_SERVING, NOT_SERVING]
        await readiness.set(True)
        assert [await health_status(channel, name) for name in (GATEWAY, "")] == [SERVING, SERVING]
        await readiness.set(False)
        assert await health_status(channel, "") == NOT_SERVING
        await readiness.set(True)
    await server.drain(0)
    await readiness.set(True)  # a worker coming back while the server drains changes nothing
    # the server no longer answers: ask its health servicer directly
    answer = await server._health.Check(health_pb2.HealthCheckRequest(service=""), None)
    assert answer.status == NOT_SERVING
