"""Domain errors shared by the library and the services.

The library raises these; a service's error interceptor maps each class to one gRPC status
code (`StatusCode` below), so a servicer never builds a status by hand. Every error may name
the offending request field, and its message says how to fix the request.
"""

from __future__ import annotations


class CleaveError(Exception):
    """Base of all cleave domain errors.

    Attributes:
        message: human-readable explanation that says how to fix the problem.
        field: the request parameter at fault (e.g. "top_p"), or None.
        status_code: name of the grpc.StatusCode member a service maps this error to.
        retry_after_s: how long a caller should wait before retrying (sent as gRPC trailing
            metadata `retry-after-ms` and HTTP `Retry-After`), or None when a retry as such
            would not help.
    """

    status_code: str = "UNKNOWN"
    retry_after_s: float | None = None

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.field = field

    def __str__(self) -> str:
        if self.field is None:
            return self.message
        return f"{self.field}: {self.message}"


class InvalidArgument(CleaveError):
    """A request parameter is malformed or out of range."""

    status_code = "INVALID_ARGUMENT"


class ResourceExhausted(CleaveError):
    """Not enough capacity (KV blocks, queue slots, memory) to accept the request now."""

    status_code = "RESOURCE_EXHAUSTED"


class NotFound(CleaveError):
    """A referenced object (request id, model, transfer handle, KV block) does not exist."""

    status_code = "NOT_FOUND"


class FailedPrecondition(CleaveError):
    """The system is not in a state that allows the operation (e.g. model not loaded)."""

    status_code = "FAILED_PRECONDITION"


class DeadlineExceeded(CleaveError):
    """The request's deadline passed before it completed."""

    status_code = "DEADLINE_EXCEEDED"


class Unavailable(CleaveError):
    """A worker or peer cannot be reached or is draining; the caller may retry elsewhere."""

    status_code = "UNAVAILABLE"
    retry_after_s = 1.0  # health checks run about once a second: a worker may be back by then


class Unauthenticated(CleaveError):
    """The caller sent no credentials, or the wrong ones (`cleave.rpc.auth`)."""

    status_code = "UNAUTHENTICATED"


class Cancelled(CleaveError):
    """The request was cancelled by the client or aborted by the server."""

    status_code = "CANCELLED"
