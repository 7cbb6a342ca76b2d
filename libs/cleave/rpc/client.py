"""Client-side helpers: channels with the same message limits as cleave servers, carrying
the caller's trace context (`cleave.rpc.client_tracing`) and, when given, the internal token
or API key (`cleave.rpc.auth`)."""

from __future__ import annotations

import grpc

from cleave.config import DEFAULT_MAX_MESSAGE_BYTES
from cleave.rpc.auth import call_metadata
from cleave.rpc.call_details import details_interceptors, with_metadata
from cleave.rpc.client_tracing import with_trace_context
from cleave.tls import TlsConfig


def channel_options(max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> list[tuple[str, int]]:
    """gRPC channel/server options that allow messages up to max_message_bytes each way."""
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
    ]


# Each channel keeps its own connections. gRPC otherwise shares them process-wide by target:
# a new channel to an address whose earlier server went away (a worker restarted on its
# address) would inherit that connection's reconnect backoff and fail its first calls at once.
LOCAL_SUBCHANNELS = ("grpc.use_local_subchannel_pool", 1)


def aio_channel(
    address: str,
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    *,
    internal_token: str | None = None,
    api_key: str | None = None,
    credentials: grpc.ChannelCredentials | None = None,
) -> grpc.aio.Channel:
    """A grpc.aio channel to a cleave service at host:port, over TLS with `credentials`
    (`cleave.tls.TlsConfig.channel_credentials` between services, `grpc.ssl_channel_credentials`
    for a client of the gateway), else plain text; calls made inside a traced request send its
    `traceparent`, and every call sends `internal_token` (calls between cleave services) or
    `api_key` (a client of the gateway) when given."""
    secrets = call_metadata(internal_token, api_key)
    rewrites = [with_trace_context]
    if secrets:
        rewrites.append(lambda details: with_metadata(details, secrets))
    options = [*channel_options(max_message_bytes), LOCAL_SUBCHANNELS]
    interceptors = details_interceptors(*rewrites)
    if credentials is None:
        return grpc.aio.insecure_channel(address, options=options, interceptors=interceptors)
    return grpc.aio.secure_channel(address, credentials, options=options, interceptors=interceptors)


def tls_credentials(tls: TlsConfig | None) -> grpc.ChannelCredentials | None:
    """Channel credentials of a process's TLS configuration (None: plain text)."""
    return None if tls is None else tls.channel_credentials()
