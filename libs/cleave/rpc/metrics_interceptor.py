"""`MetricsInterceptor`: every call's method, final status code and duration, for metrics.

It runs outermost, around `RequestInterceptor` (`serve(..., metrics=...)`), so it sees the
status code the caller gets: the servicer's own abort, the code `RequestInterceptor` mapped
an exception to (it aborts with it), UNAUTHENTICATED from the auth check, CANCELLED when the
caller went away. A stream is timed from its start to its last message.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Protocol

import grpc

from cleave.rpc.errors import map_exception
from cleave.rpc.method_handlers import responses_of, rewrap


class CallObserver(Protocol):
    """Where finished calls go (`cleave.metrics.grpc_server.GrpcServerMetrics`)."""

    def observe(self, method: str, code: str, seconds: float) -> None:
        """One finished call: "/package.Service/Method", status code name, seconds."""


def _code_of(exc: BaseException, context: grpc.aio.ServicerContext) -> str:
    if isinstance(exc, grpc.aio.AbortError):
        return (context.code() or grpc.StatusCode.UNKNOWN).name
    if isinstance(exc, (asyncio.CancelledError, GeneratorExit)):
        return grpc.StatusCode.CANCELLED.name
    return map_exception(exc, "").code.name  # only without RequestInterceptor inside


def _unary(behavior: Callable[..., Awaitable[Any]], method: str, observer: CallObserver):
    async def handler(request: Any, context: grpc.aio.ServicerContext) -> Any:
        started = time.perf_counter()
        try:
            response = await behavior(request, context)
        except BaseException as exc:  # noqa: BLE001 - observed, then re-raised
            observer.observe(method, _code_of(exc, context), time.perf_counter() - started)
            raise
        observer.observe(method, grpc.StatusCode.OK.name, time.perf_counter() - started)
        return response

    return handler


def _stream(behavior: Callable[..., Any], method: str, observer: CallObserver):
    async def handler(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        started = time.perf_counter()
        try:
            async with contextlib.aclosing(responses_of(behavior(request, context))) as responses:
                async for response in responses:
                    yield response
        except BaseException as exc:  # noqa: BLE001 - observed, then re-raised
            observer.observe(method, _code_of(exc, context), time.perf_counter() - started)
            raise
        observer.observe(method, grpc.StatusCode.OK.name, time.perf_counter() - started)

    return handler


class MetricsInterceptor(grpc.aio.ServerInterceptor):
    """Reports every call's method, status code and duration to `observer`."""

    def __init__(self, observer: CallObserver) -> None:
        self.observer = observer

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        method, observer = handler_call_details.method, self.observer
        return rewrap(handler, lambda behavior: _unary(behavior, method, observer),
                      lambda behavior: _stream(behavior, method, observer))
