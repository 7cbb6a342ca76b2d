"""One gRPC call to a worker, with the gateway's error mapping and deadline arithmetic.

A worker's status code becomes the matching `CleaveError` (the client sees the worker's
reason, prefixed with where it came from); an INVALID_ARGUMENT is the request's fault, so the
client sees only the worker's reason under the field it named, as a GenerateRequest path,
as for the gateway's own checks (where it came from goes to the log); UNAVAILABLE also takes
the worker out of rotation; anything else is Unavailable, which callers may retry elsewhere.

DEADLINE_EXCEEDED is the client's only when the request's own deadline ran out. A worker that
reports it about a call it made in turn (a prefill worker's Admit on a decode worker that
never answered) failed, like any worker that could not do the call: Unavailable, retried.

A worker that stops answering without closing its connections (hung, or its host gone)
would hold a call without a deadline forever: a call also ends, Unavailable, when the pool
declares its worker lost (or the decode worker behind a Prefill), so the start moves on.
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


async def call_worker(
    pool: WorkerPool, call: Awaitable[T], worker: WorkerHandle, method: str, *,
    deadline: float | None = None, behind: WorkerHandle | None = None,
) -> T:
    """Await `call` (a `method` RPC on `worker`), raising its failure as a CleaveError.

    Args:
        deadline: the request's (event-loop time; None without one), which tells whose
            deadline a DEADLINE_EXCEEDED was.
        behind: the decode worker a Prefill drives: should the pool declare it lost, the
            call ends as when the decode worker fails it (Unavailable, field "decode").
    """
    where = f"{method} on {worker.role} worker {worker.address}"
    watched = [(worker, None), *([(behind, "decode")] if behind is not None else [])]
    pending = asyncio.ensure_future(call)
    for watched_worker, field in watched:
        if pool.is_lost(watched_worker):  # lost before the call: no later loss would end it
            _drop(pending, call)
            raise _lost(where, watched_worker, field)
    losses = {watched_worker.next_loss(): (watched_worker, field) for watched_worker, field in watched}
    try:
        await asyncio.wait({pending, *losses}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        _drop(pending, call)
        raise
    if not pending.done():
        _drop(pending, call)  # the worker, should it ever run again, aborts the request
        lost_worker, field = next(losses[loss] for loss in losses if loss.done())
        raise _lost(where, lost_worker, field)
    try:
        return pending.result()
    except grpc.aio.AioRpcError as error:
        error_type = error_type_for(error.code())
        if error_type is InvalidArgument:  # the request's fault: named by its field, as the gateway's own checks
            detail = error_detail(error)
            field = detail.field if detail is not None and detail.field else None
            reason = (error.details() or "").removeprefix(f"{field}: " if field else "")
            log.info("worker refused the request", where=where, field=field, reason=reason)
            raise request_field(InvalidArgument(reason, field=field)) from None
        if error_type is DeadlineExceeded and not _request_deadline_passed(error, deadline):
            error_type = None  # a call the worker made timed out: the worker failed, retry elsewhere
        if error_type is not None:
            raise error_type(f"{where}: {error.details()}") from None
        behind_failed = _behind(error)
        if error.code() is grpc.StatusCode.UNAVAILABLE and not behind_failed:
            await pool.set_healthy(worker, False)
        raise Unavailable(f"{where} failed ({error.code().name}: {error.details()}); retry",
                          field="decode" if behind_failed else None) from None


def _lost(where: str, lost_worker: WorkerHandle, field: str | None) -> Unavailable:
    return Unavailable(f"{where} gave up: {lost_worker.role} worker {lost_worker.address} is lost "
                       f"({lost_worker.failed_checks} health checks unanswered); retry", field=field)


def _drop(pending: asyncio.Future, call: Awaitable) -> None:
    """Cancel a call nobody awaits any more (the RPC too, even if its wait never began); its
    outcome, should it end first, is read."""
    pending.cancel()
    pending.add_done_callback(lambda done: done.cancelled() or done.exception())
    if isinstance(call, grpc.aio.Call):
        call.cancel()


def _request_deadline_passed(error: grpc.aio.AioRpcError, deadline: float | None) -> bool:
    """Whether a DEADLINE_EXCEEDED is the request's deadline running out: the call's timeout,
    set from it, fired here (no worker sent an ErrorDetail), or it has passed anyway. One a
    worker sent, before the request's deadline, is about a call of the worker's own."""
    if deadline is None:
        return False  # the call had no timeout: the worker's own call timed out
    return error_detail(error) is None or asyncio.get_running_loop().time() >= deadline


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
