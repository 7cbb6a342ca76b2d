"""One gRPC call to a worker, with the gateway's error mapping and deadline arithmetic.

A worker's status code becomes the matching `CleaveError` (the client sees the worker's
reason, prefixed with where it came from); an INVALID_ARGUMENT is the request's fault, so the
client sees only the worker's reason under the field it named, as a GenerateRequest path,
as for the gateway's own checks (where it came from goes to the log); UNAVAILABLE also takes
the worker out of rotation; anything else is Unavailable, which callers may retry elsewhere.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

import grpc
import structlog

from cleave.errors import DeadlineExceeded, InvalidArgument, Unavailable
from cleave.rpc.errors import error_detail, error_type_for
from services.gateway.convert import request_field
from services.gateway.workers import WorkerHandle, WorkerPool

T = TypeVar("T")
log = structlog.get_logger("cleave.gateway.workers")


async def call_worker(pool: WorkerPool, call: Awaitable[T], worker: WorkerHandle, method: str) -> T:
    """Await `call` (a `method` RPC on `worker`), raising its failure as a CleaveError."""
    try:
        return await call
    except grpc.aio.AioRpcError as error:
        where = f"{method} on {worker.role} worker {worker.address}"
        error_type = error_type_for(error.code())
        if error_type is InvalidArgument:  # the request's fault: named by its field, as the gateway's own checks
            detail = error_detail(error)
            field = detail.field if detail is not None and detail.field else None
            reason = (error.details() or "").removeprefix(f"{field}: " if field else "")
            log.info("worker refused the request", where=where, field=field, reason=reason)
            raise request_field(InvalidArgument(reason, field=field)) from None
        if error_type is not None:
            raise error_type(f"{where}: {error.details()}") from None
        behind = _behind(error)
        if error.code() is grpc.StatusCode.UNAVAILABLE and not behind:
            await pool.set_healthy(worker, False)
        raise Unavailable(f"{where} failed ({error.code().name}: {error.details()}); retry",
                          field="decode" if behind else None) from None


def _behind(error: grpc.aio.AioRpcError) -> bool:
    """Whether an UNAVAILABLE is about the decode worker a prefill worker called for the
    request (ErrorDetail.field "decode"), not about the worker that answered."""
    detail = error_detail(error)
    return detail is not None and detail.field == "decode"


def time_left(deadline: float | None) -> float | None:
    """Seconds until `deadline` (event-loop time), None without one; DeadlineExceeded once past."""
    if deadline is None:
        return None
    remaining = deadline - asyncio.get_running_loop().time()
    if remaining <= 0:
        raise DeadlineExceeded("the request's deadline passed; allow more time or ask for fewer tokens")
    return remaining
