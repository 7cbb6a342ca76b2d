"""cleave.rpc: the gRPC plumbing every service shares.

`serve()` starts a grpc.aio server with health (`grpc.health.v1`), reflection, the request
interceptor (request ids, call logs, exceptions -> status codes) and SIGTERM draining.
"""

from cleave.rpc.client import aio_channel, channel_options
from cleave.rpc.errors import ERROR_DETAIL_KEY, RETRY_AFTER_KEY, error_detail, map_exception
from cleave.rpc.interceptor import REQUEST_ID_KEY, RequestInterceptor, current_request_id
from cleave.rpc.server import (
    Drainable,
    Lifecycle,
    Readiness,
    Server,
    ServiceRegistration,
    run_service,
    serve,
    write_port_file,
)

__all__ = [
    "Drainable",
    "ERROR_DETAIL_KEY",
    "REQUEST_ID_KEY",
    "RETRY_AFTER_KEY",
    "Lifecycle",
    "Readiness",
    "RequestInterceptor",
    "Server",
    "ServiceRegistration",
    "aio_channel",
    "channel_options",
    "current_request_id",
    "error_detail",
    "map_exception",
    "run_service",
    "serve",
    "write_port_file",
]
