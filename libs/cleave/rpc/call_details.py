"""Client interceptors that rewrite each call's details (its metadata) before it goes out.

grpc.aio files an interceptor under the first call type it implements, so a rewrite that
every call must get takes one interceptor per call type. `details_interceptors` builds those
four for any number of rewrites, applied in order inside one interceptor per call, so a
channel pays one interceptor hop per call however many rewrites it carries (trace context,
secrets).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import grpc

Rewrite = Callable[[grpc.aio.ClientCallDetails], grpc.aio.ClientCallDetails]
Continuation = Callable[[grpc.aio.ClientCallDetails, Any], Awaitable[Any]]


class _Rewriting:
    def __init__(self, rewrites: Sequence[Rewrite]) -> None:
        self._rewrites = tuple(rewrites)

    def _details(self, details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        for rewrite in self._rewrites:
            details = rewrite(details)
        return details


class _UnaryUnary(_Rewriting, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation: Continuation, client_call_details, request):  # type: ignore[no-untyped-def]
        return await continuation(self._details(client_call_details), request)


class _UnaryStream(_Rewriting, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation: Continuation, client_call_details, request):  # type: ignore[no-untyped-def]
        return await continuation(self._details(client_call_details), request)


class _StreamUnary(_Rewriting, grpc.aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(self, continuation: Continuation, client_call_details, request_iterator):  # type: ignore[no-untyped-def]
        return await continuation(self._details(client_call_details), request_iterator)


class _StreamStream(_Rewriting, grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(self, continuation: Continuation, client_call_details, request_iterator):  # type: ignore[no-untyped-def]
        return await continuation(self._details(client_call_details), request_iterator)


def details_interceptors(*rewrites: Rewrite) -> tuple[grpc.aio.ClientInterceptor, ...]:
    """One interceptor per call type applying `rewrites` in order (none without rewrites)."""
    if not rewrites:
        return ()
    return (_UnaryUnary(rewrites), _UnaryStream(rewrites), _StreamUnary(rewrites), _StreamStream(rewrites))


def with_metadata(details: grpc.aio.ClientCallDetails, pairs: Sequence[tuple[str, str]]) -> grpc.aio.ClientCallDetails:
    """`details` with `pairs` added to its metadata; keys the caller set itself are kept."""
    metadata = tuple(details.metadata or ())
    sent = {key for key, _ in metadata}
    added = tuple(pair for pair in pairs if pair[0] not in sent)
    if not added:
        return details
    return details._replace(metadata=grpc.aio.Metadata(*metadata, *added))  # type: ignore[attr-defined]
