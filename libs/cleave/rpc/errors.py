"""Map exceptions raised by servicers and backends to gRPC status codes.

Domain errors (`cleave.errors`) carry the name of their status code; a few built-in
exceptions have an obvious one; anything else is a bug and becomes INTERNAL, logged with its
traceback and never echoed to the client. The mapped status also travels as a serialized
`cleave.v1.ErrorDetail` in the trailing metadata key `cleave-error-bin`; an error that says
when to retry (`CleaveError.retry_after_s`, e.g. UNAVAILABLE) adds `retry-after-ms`.
"""

from __future__ import annotations

from dataclasses import dataclass

import grpc

from cleave.errors import (
    CleaveError,
    DeadlineExceeded,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
)
from cleave.proto.cleave.v1 import common_pb2

ERROR_DETAIL_KEY = "cleave-error-bin"
RETRY_AFTER_KEY = "retry-after-ms"
# A message travels in the trailers twice (grpc-message, percent-encoded, and the ErrorDetail);
# clients refuse trailers over 8 KiB, and the call would then end RESOURCE_EXHAUSTED instead.
MAX_MESSAGE_BYTES = 1024
_ERRORS_BY_CODE: dict[grpc.StatusCode, type[CleaveError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgument,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ResourceExhausted,
    grpc.StatusCode.NOT_FOUND: NotFound,
    grpc.StatusCode.FAILED_PRECONDITION: FailedPrecondition,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceeded,
}
_BUILTIN_CODES: tuple[tuple[type[BaseException], grpc.StatusCode], ...] = (
    (NotImplementedError, grpc.StatusCode.UNIMPLEMENTED),
    (TimeoutError, grpc.StatusCode.DEADLINE_EXCEEDED),
)


@dataclass(frozen=True)
class MappedError:
    """The status a failed call ends with."""

    code: grpc.StatusCode
    message: str
    detail: common_pb2.ErrorDetail
    is_bug: bool  # INTERNAL from an unexpected exception: log the traceback
    retry_after_ms: int | None = None  # when the caller may retry, if the error says

    def trailing_metadata(self) -> tuple[tuple[str, str | bytes], ...]:
        """The ErrorDetail, and `retry-after-ms` when the error says when to retry."""
        detail = ((ERROR_DETAIL_KEY, self.detail.SerializeToString()),)
        if self.retry_after_ms is None:
            return detail
        return (*detail, (RETRY_AFTER_KEY, str(self.retry_after_ms)))


def map_exception(exc: BaseException, request_id: str) -> MappedError:
    """The gRPC status, client-facing message and ErrorDetail for an exception."""
    field = ""
    is_bug = False
    retry_after_ms = None
    if isinstance(exc, CleaveError):
        code = getattr(grpc.StatusCode, exc.status_code, grpc.StatusCode.UNKNOWN)
        message = str(exc)  # "field: message" when the error names a field
        field = exc.field or ""
        if exc.retry_after_s is not None:
            retry_after_ms = round(exc.retry_after_s * 1000)
    else:
        for exc_type, builtin_code in _BUILTIN_CODES:
            if isinstance(exc, exc_type):
                code, message = builtin_code, str(exc) or exc_type.__name__
                break
        else:
            code, is_bug = grpc.StatusCode.INTERNAL, True
            message = f"internal error ({type(exc).__name__}); request id {request_id}"
    message, field = clipped(message, MAX_MESSAGE_BYTES), clipped(field, MAX_MESSAGE_BYTES // 4)
    detail = common_pb2.ErrorDetail(
        code=error_code_for(code), message=message, field=field, request_id=request_id
    )
    return MappedError(code=code, message=message, detail=detail, is_bug=is_bug, retry_after_ms=retry_after_ms)


def clipped(text: str, max_bytes: int) -> str:
    """`text` cut to at most `max_bytes` of UTF-8, ending " ..." where it was cut (a message
    quoting a long value a client sent)."""
    if len(text.encode()) <= max_bytes:
        return text
    return text.encode()[:max_bytes - 4].decode(errors="ignore") + " ..."


def error_code_for(code: grpc.StatusCode) -> int:
    """The cleave.v1.ErrorCode value that mirrors a gRPC status code."""
    name = f"ERROR_CODE_{code.name}"
    if name in common_pb2.ErrorCode.keys():
        return common_pb2.ErrorCode.Value(name)
    return common_pb2.ERROR_CODE_INTERNAL


def error_type_for(code: grpc.StatusCode) -> type[CleaveError] | None:
    """The domain error a peer's status code maps back to (client side), or None for codes
    that say the peer itself failed (UNAVAILABLE, INTERNAL, ...)."""
    return _ERRORS_BY_CODE.get(code)


def error_detail(error: grpc.RpcError) -> common_pb2.ErrorDetail | None:
    """Read the ErrorDetail a cleave server attached to a failed call (client side)."""
    trailing = error.trailing_metadata() if hasattr(error, "trailing_metadata") else None
    for key, value in trailing or ():
        if key == ERROR_DETAIL_KEY:
            return common_pb2.ErrorDetail.FromString(value)
    return None
