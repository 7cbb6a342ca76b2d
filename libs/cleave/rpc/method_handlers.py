"""Wrapping a gRPC method handler's behaviour, whatever its cardinality: what the server
interceptors (`interceptor`, `metrics_interceptor`) share."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc

Behavior = Callable[..., Any]


def rewrap(
    handler: grpc.RpcMethodHandler,
    unary_response: Callable[[Behavior], Behavior],
    stream_response: Callable[[Behavior], Behavior],
    single_request_deserializer: Callable[[bytes], Any] | None = None,
) -> grpc.RpcMethodHandler:
    """`handler` with its behaviour wrapped by `unary_response` (calls that answer once) or
    `stream_response` (calls that stream answers); `single_request_deserializer` replaces the
    request deserializer of calls that take one request."""
    kwargs = {"request_deserializer": handler.request_deserializer,
              "response_serializer": handler.response_serializer}
    single = {**kwargs, "request_deserializer": single_request_deserializer or handler.request_deserializer}
    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(unary_response(handler.unary_unary), **single)
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(unary_response(handler.stream_unary), **kwargs)
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(stream_response(handler.unary_stream), **single)
    return grpc.stream_stream_rpc_method_handler(stream_response(handler.stream_stream), **kwargs)


async def responses_of(result: Any) -> AsyncIterator[Any]:
    """The responses a streaming behaviour's `result` yields, or none from a coroutine that
    writes with `context.write()`. An async generator is closed when its responses end for
    any reason, so a call the client cancelled runs the handler's cleanup (a `finally`) at
    once, not whenever the generator is garbage collected. Iterate this under
    `contextlib.aclosing` for that to hold through the wrapper itself."""
    if not hasattr(result, "__aiter__"):
        await result
        return
    closing = contextlib.aclosing(result) if hasattr(result, "aclose") else contextlib.nullcontext(result)
    async with closing as responses:
        async for response in responses:
            yield response
