"""The one place where the gateway's internal failures become what a client may see.

Errors raised while routing a request name the workers involved ("lost decode worker
127.0.0.1:41231: UNAVAILABLE", a peer's "ipv4:10.0.0.7:50051: Connection refused"): the
gateway's logs need that, its clients must not learn the cluster's addresses. Both public
APIs (gRPC `Generate`/`Abort` and the OpenAI HTTP routes) reach the routing logic through a
`GatewayBackend`; `ClientSafeBackend` wraps it so every error leaving it has its addresses
replaced, a server-side failure carries the request id to quote, and an internal failure is
reduced to "internal error". The original of what was withheld is logged once, with the
request id (not for an error that only gained the id: a capped tenant's refusals would
otherwise log a line each).
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import AsyncIterator

import structlog

from cleave.errors import CleaveError
from services.gateway.backend import BackendLayer, GenerateChunk, GenerateSpec

WITHHELD = "(internal address)"
# A peer's address in any of the forms gRPC and the services write: an optional scheme
# (ipv4:, ipv6:, unix:, dns:///, http://), then [v6]:port, host:port, a bare IPv4 address, or a
# unix socket path.
_ADDRESS = re.compile(
    r"(?:\b(?:ipv4|ipv6|dns|https?|grpc|tcp):(?:/{2,3})?)?"
    r"(?:\[[0-9A-Fa-f.%\w]*:[0-9A-Fa-f:.%\w]*\](?::\d{1,5})?"
    r"|\b(?:\d{1,3}\.){3}\d{1,3}(?::\d{1,5})?\b"
    r"|\b[A-Za-z0-9](?:[A-Za-z0-9.-]*[A-Za-z0-9])?:\d{1,5}\b)"
    r"|\bunix:(?:/{1,3})?[^\s,;)]+"
)
# Failures of the service itself: the client learns only that, and the request id to quote.
_SERVER_FAULTS = frozenset({"INTERNAL", "UNKNOWN", "DATA_LOSS"})
# Failures of a worker or a peer, which the client may retry: the reason stays, addresses go.
_WORKER_FAULTS = frozenset({"UNAVAILABLE", "ABORTED", "DEADLINE_EXCEEDED", "RESOURCE_EXHAUSTED"})
log = structlog.get_logger("cleave.gateway.errors")


def withhold_addresses(text: str) -> str:
    """`text` with every network address and socket path replaced by `WITHHELD`."""
    return _ADDRESS.sub(WITHHELD, text)


def client_message(error: CleaveError, request_id: str) -> str:
    """What the client is told about `error` (without its field prefix)."""
    return _told(error, request_id)[0]


def _told(error: CleaveError, request_id: str) -> tuple[str, bool]:
    """`client_message`, and whether it withholds anything of `error`'s (more than the request
    id added to a refusal the client may retry)."""
    if error.status_code in _SERVER_FAULTS:
        return f"internal error; request id {request_id}", True
    message, num_withheld = _ADDRESS.subn(WITHHELD, error.message)
    if error.status_code in _WORKER_FAULTS and request_id not in message:
        message = f"{message} (request id {request_id})"
    return message, num_withheld > 0


def client_error(error: BaseException, request_id: str) -> BaseException:
    """`error` as a client may see it: the same class, status, field and retry hint, with
    `client_message`'s text. Other exceptions pass through: both APIs already answer them with
    a bare "internal error" and log the traceback."""
    if not isinstance(error, CleaveError):
        return error
    message, withheld = _told(error, request_id)
    if message == error.message:
        return error
    if withheld:  # else only the request id was added: nothing to keep for the logs
        log.warning("failure reported to the client without internal details", request_id=request_id,
                    error=str(error), client_message=message, status=error.status_code)
    safe = type(error).__new__(type(error))
    safe.__dict__.update(error.__dict__)
    safe.args = (message,)
    safe.message = message
    return safe


class ClientSafeBackend(BackendLayer):
    """A GatewayBackend whose errors are safe to show a client (`client_error`).

    Args:
        backend: the gateway's backend (metered routing).
    """

    async def generate(self, spec: GenerateSpec) -> AsyncIterator[GenerateChunk]:
        async with contextlib.aclosing(self.backend.generate(spec)) as chunks:
            try:
                async for chunk in chunks:
                    yield chunk
            except CleaveError as error:
                safe = client_error(error, spec.request_id)
                if safe is error:
                    raise
                raise safe from error

    async def abort(self, request_id: str, sample_index: int | None = None) -> bool:
        try:
            return await self.backend.abort(request_id, sample_index)
        except CleaveError as error:
            safe = client_error(error, request_id)
            if safe is error:
                raise
            raise safe from error
