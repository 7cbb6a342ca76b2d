"""aio_channel: a new channel connects afresh, whatever an older channel to the same address
went through (a worker restarted on its address)."""

from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from cleave.proto.cleave.v1 import gateway_pb2_grpc
from cleave.rpc import ServiceRegistration, aio_channel, serve


async def start(address: str):
    registration = ServiceRegistration("cleave.v1.Gateway", gateway_pb2_grpc.GatewayServicer(),
                                       gateway_pb2_grpc.add_GatewayServicer_to_server)
    server = await serve([registration], address, handle_signals=False)
    await server.set_ready()
    return server


async def check(channel: grpc.aio.Channel) -> int:
    stub = health_pb2_grpc.HealthStub(channel)
    return (await stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=10)).status


async def test_a_new_channel_does_not_inherit_an_old_ones_reconnect_backoff():
    first = await start("127.0.0.1:0")
    address = first.address
    async with aio_channel(address) as old:
        assert await check(old) == health_pb2.HealthCheckResponse.SERVING
        await first.drain(0)
        with pytest.raises(grpc.aio.AioRpcError) as refused:  # the old channel's connection now backs off
            await check(old)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        second = await start(address)  # the worker back on its address
        try:
            async with aio_channel(address) as new:
                assert await check(new) == health_pb2.HealthCheckResponse.SERVING  # no wait_for_ready needed
        finally:
            await second.drain(0)
