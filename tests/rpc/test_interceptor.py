"""The request interceptor: request-id binding, call logs, exceptions -> status codes; a
handler that fails writing to a call its client cancelled is a cancel, not a bug."""

from __future__ import annotations

import asyncio
import io
import json

import grpc
import pytest
import structlog

from cleave import errors
from cleave.logging import configure_logging
from cleave.proto.cleave.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from cleave.rpc import RETRY_AFTER_KEY, ServiceRegistration, aio_channel, current_request_id, error_detail, serve


class ScriptedServicer(gateway_pb2_grpc.GatewayServicer):
    """Abort raises `self.error` (if set) and records the bound context; Generate yields one
    response before raising `self.error`."""

    def __init__(self) -> None:
        self.error: BaseException | None = None
        self.seen: list[tuple[str | None, dict]] = []

    async def Abort(self, request, context):
        self.seen.append((current_request_id(), structlog.contextvars.get_contextvars()))
        structlog.get_logger("test").info("inside handler")
        if self.error is not None:
            raise self.error
        return common_pb2.AbortResponse(found=True)

    async def Generate(self, request, context):
        yield gateway_pb2.GenerateResponse(request_id="first")
        if self.error is not None:
            raise self.error

    async def ListModels(self, request, context):
        await context.abort(grpc.StatusCode.PERMISSION_DENIED, "servicer chose this status")


@pytest.fixture
async def running():
    servicer = ScriptedServicer()
    registration = ServiceRegistration(
        "cleave.v1.Gateway", servicer, gateway_pb2_grpc.add_GatewayServicer_to_server
    )
    server = await serve([registration], "127.0.0.1:0", handle_signals=False)
    channel = aio_channel(server.address)
    yield servicer, gateway_pb2_grpc.GatewayStub(channel)
    await channel.close()
    await server.drain(0)


async def test_request_id_from_metadata_is_bound_and_returned(running):
    servicer, stub = running
    call = stub.Abort(common_pb2.AbortRequest(request_id="r"), metadata=(("x-request-id", "rid-42"),))
    assert (await call).found
    assert servicer.seen == [("rid-42", {"request_id": "rid-42", "rpc": "/cleave.v1.Gateway/Abort"})]
    assert ("x-request-id", "rid-42") in tuple(await call.trailing_metadata())
    assert current_request_id() is None  # nothing leaks into the test's context


async def test_request_id_is_generated_when_absent(running):
    servicer, stub = running
    call = stub.Abort(common_pb2.AbortRequest(request_id="r"))
    await call
    await stub.Abort(common_pb2.AbortRequest(request_id="r"))
    (first, _), (second, _) = servicer.seen
    assert len(first) == 32 and int(first, 16) >= 0 and first != second
    assert ("x-request-id", first) in tuple(await call.trailing_metadata())


async def test_each_call_is_logged_with_method_code_and_duration(running):
    servicer, stub = running
    stream = io.StringIO()
    configure_logging("INFO", json=True, stream=stream)
    try:
        await stub.Abort(common_pb2.AbortRequest(request_id="r"), metadata=(("x-request-id", "rid-7"),))
        servicer.error = errors.NotFound("no such request", field="request_id")
        with pytest.raises(grpc.aio.AioRpcError):
            await stub.Abort(common_pb2.AbortRequest(request_id="r"), metadata=(("x-request-id", "rid-8"),))
    finally:
        structlog.reset_defaults()
    lines = [json.loads(line) for line in stream.getvalue().splitlines()]
    inside = [line for line in lines if line["event"] == "inside handler"]
    assert [line["request_id"] for line in inside] == ["rid-7", "rid-8"]
    calls = [line for line in lines if line["event"] == "rpc"]
    assert [(c["request_id"], c["rpc"], c["code"], c["level"]) for c in calls] == [
        ("rid-7", "/cleave.v1.Gateway/Abort", "OK", "info"),
        ("rid-8", "/cleave.v1.Gateway/Abort", "NOT_FOUND", "warning"),
    ]
    assert all(isinstance(c["duration_ms"], float) and c["duration_ms"] >= 0 for c in calls)


@pytest.mark.parametrize(
    "error_class",
    [
        errors.InvalidArgument,
        errors.ResourceExhausted,
        errors.NotFound,
        errors.FailedPrecondition,
        errors.DeadlineExceeded,
        errors.Unavailable,
        errors.Cancelled,
    ],
)
async def test_domain_errors_map_to_their_status_code(running, error_class):
    servicer, stub = running
    servicer.error = error_class("explain the fix", field="sampling.top_p")
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await stub.Abort(common_pb2.AbortRequest(request_id="r"), metadata=(("x-request-id", "rid-1"),))
    assert raised.value.code() == getattr(grpc.StatusCode, error_class.status_code)
    assert raised.value.details() == "sampling.top_p: explain the fix"
    detail = error_detail(raised.value)
    assert detail.field == "sampling.top_p" and detail.request_id == "rid-1"
    assert common_pb2.ErrorCode.Name(detail.code) == f"ERROR_CODE_{error_class.status_code}"
    retry_after = [value for key, value in raised.value.trailing_metadata() or () if key == RETRY_AFTER_KEY]
    assert retry_after == (["1000"] if error_class is errors.Unavailable else [])  # only UNAVAILABLE is retried


async def test_unexpected_exception_is_internal_without_leaking_its_message(running):
    servicer, stub = running
    servicer.error = RuntimeError("secret path /etc/shadow")
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await stub.Abort(common_pb2.AbortRequest(request_id="r"), metadata=(("x-request-id", "rid-2"),))
    assert raised.value.code() == grpc.StatusCode.INTERNAL
    assert raised.value.details() == "internal error (RuntimeError); request id rid-2"


async def test_not_implemented_maps_to_unimplemented(running):
    servicer, stub = running
    servicer.error = NotImplementedError("Abort is not wired yet")
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await stub.Abort(common_pb2.AbortRequest(request_id="r"))
    assert raised.value.code() == grpc.StatusCode.UNIMPLEMENTED
    assert raised.value.details() == "Abort is not wired yet"


async def test_streaming_error_after_a_message_keeps_the_message_and_maps_the_code(running):
    servicer, stub = running
    servicer.error = errors.ResourceExhausted("no free KV blocks; retry later")
    call = stub.Generate(gateway_pb2.GenerateRequest(text="hi"))
    assert (await call.read()).request_id == "first"
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await call.read()
    assert raised.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert raised.value.details() == "no free KV blocks; retry later"


async def test_streaming_success_ends_with_ok(running):
    _, stub = running
    responses = [r async for r in stub.Generate(gateway_pb2.GenerateRequest(text="hi"))]
    assert [r.request_id for r in responses] == ["first"]


async def test_status_set_by_the_servicer_passes_through(running):
    _, stub = running
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await stub.ListModels(gateway_pb2.ListModelsRequest())
    assert raised.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert raised.value.details() == "servicer chose this status"


@pytest.mark.parametrize("echoed", ["r" * 20_000, "é" * 20_000], ids=["ascii", "accented"])
async def test_an_error_echoing_a_long_value_keeps_its_code(running, echoed):
    """A message quoting a client's long value travels in the trailers twice (grpc-message
    and the ErrorDetail); past the client's metadata limit the call would end
    RESOURCE_EXHAUSTED instead of with its own code."""
    servicer, stub = running
    servicer.error = errors.InvalidArgument(f"unknown role {echoed!r}; use one of user, assistant", field="role")
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await stub.Abort(common_pb2.AbortRequest(request_id="r"))
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT, raised.value.details()
    assert raised.value.details().startswith(f"role: unknown role '{echoed[:100]}")
    assert len(raised.value.details().encode()) <= 1024
    detail = error_detail(raised.value)
    assert detail.field == "role" and detail.message == raised.value.details()


async def test_an_overlong_request_id_is_replaced(running):
    """An x-request-id longer than a request id may be is not echoed into the trailers (nor
    into every log line): the call gets an id of its own, as without one."""
    servicer, stub = running
    servicer.error = errors.NotFound("no such request", field="request_id")
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await stub.Abort(common_pb2.AbortRequest(request_id="r"), metadata=(("x-request-id", "q" * 7000),))
    assert raised.value.code() == grpc.StatusCode.NOT_FOUND, raised.value.details()
    ((seen, _),) = servicer.seen
    assert len(seen) == 32 and error_detail(raised.value).request_id == seen
    assert ("x-request-id", seen) in tuple(raised.value.trailing_metadata())


class CleanupServicer(gateway_pb2_grpc.GatewayServicer):
    """Generate writes one response, runs its cleanup to the end when the call is cancelled
    (as the prefill worker's does), then writes again, to the finished call."""

    def __init__(self) -> None:
        self.waiting, self.done = asyncio.Event(), asyncio.Event()

    async def Generate(self, request, context):
        await context.write(gateway_pb2.GenerateResponse(request_id="first"))
        try:
            self.waiting.set()
            await asyncio.Event().wait()  # until the call is cancelled
        except asyncio.CancelledError:
            pass  # the cleanup goes on
        try:
            await context.write(gateway_pb2.GenerateResponse(request_id="late"))
        finally:
            self.done.set()


async def test_a_handler_that_fails_writing_to_a_cancelled_call_is_logged_as_cancelled():
    servicer = CleanupServicer()
    registration = ServiceRegistration("cleave.v1.Gateway", servicer, gateway_pb2_grpc.add_GatewayServicer_to_server)
    server = await serve([registration], "127.0.0.1:0", handle_signals=False)
    channel = aio_channel(server.address)
    with structlog.testing.capture_logs() as logs:
        try:
            call = gateway_pb2_grpc.GatewayStub(channel).Generate(gateway_pb2.GenerateRequest())
            assert (await call.read()).request_id == "first"
            await asyncio.wait_for(servicer.waiting.wait(), 30)
            call.cancel()
            await asyncio.wait_for(servicer.done.wait(), 30)
        finally:
            await channel.close()
            await server.drain(0)  # after the handler's end (and its call's log line)
    rpc = [entry for entry in logs if entry["event"].startswith("rpc")]
    assert [(entry["event"], entry.get("code")) for entry in rpc] == [
        ("rpc handler failed after its call was cancelled", None), ("rpc", "CANCELLED")]
    assert "exc_info" not in rpc[0] and rpc[0]["error"]  # what failed, without a traceback
