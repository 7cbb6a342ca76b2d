"""Who may call a cleave service: the internal token between services, the API key on the gateway.

Both are one shared secret in one metadata entry, checked the same way:

- internal token: every call a service makes to another (gateway -> prefill/decode,
  prefill -> decode, workers -> kvstore, Handshake) carries `x-cleave-internal-token: <token>`,
  added by the channel (`aio_channel(..., internal_token=)`); prefill, decode and kvstore
  refuse a call without it, or with another, as UNAUTHENTICATED.
- API key: the gateway's public gRPC service asks for `authorization: Bearer <key>`, the
  same header its HTTP API asks for (`ApiKeys.tenant`). A gateway may take several keys
  (`cleave.api_keys.ApiKeys`), any one of them: with more than one, each is a tenant whose
  requests share cached prompt prefixes only with each other (`services.gateway.tenants`).

Health and reflection stay open, so probes and `grpcurl list` need no secret. A secret of
None turns its check off. A sent secret is looked up by its SHA-256 digest among the
accepted ones' (`cleave.api_keys.secret_digest`): one lookup however many keys a gateway
takes, and how far two digests agree tells nothing of the secrets behind them.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from cleave.api_keys import ApiKeys, bearer, key_tag, secret_digest
from cleave.errors import Unauthenticated

__all__ = ["ApiKeys", "MetadataAuth", "api_key_auth", "bearer", "call_metadata", "internal_auth", "key_tag"]

INTERNAL_TOKEN_KEY = "x-cleave-internal-token"
AUTHORIZATION_KEY = "authorization"  # gRPC metadata keys are lower case; HTTP's is `Authorization`
OPEN_METHOD_PREFIXES = ("/grpc.health.", "/grpc.reflection.")


@dataclass(frozen=True)
class MetadataAuth:
    """Refuses calls whose `key` metadata is none of the accepted values (health and reflection excepted).

    Run by `cleave.rpc.RequestInterceptor` before the handler; a refusal is UNAUTHENTICATED
    and names the missing entry and how to set it.
    """

    key: str
    expected: frozenset[bytes] = field(repr=False)  # `secret_digest`s of the accepted values
    what: str  # the secret, as refusals name it: "the internal token"
    how_to_fix: str

    def check(self, method: str, metadata: Iterable[tuple[str, Any]]) -> None:
        """Raise Unauthenticated unless `method` is open or `metadata` carries the secret."""
        if method.startswith(OPEN_METHOD_PREFIXES):
            return
        sent = next((value for key, value in metadata if key == self.key), None)
        if sent is None:
            raise Unauthenticated(f"{method} needs {self.what} in the '{self.key}' metadata; {self.how_to_fix}")
        if isinstance(sent, bytes) or secret_digest(sent) not in self.expected:
            raise Unauthenticated(f"{method}: {self.what} in '{self.key}' is wrong; {self.how_to_fix}")


def internal_auth(token: str | None) -> MetadataAuth | None:
    """The check prefill, decode and kvstore run (None: no token configured, calls open)."""
    if token is None:
        return None
    return MetadataAuth(
        INTERNAL_TOKEN_KEY, frozenset({secret_digest(token)}), "the internal token",
        "start every service of the stack with the same CLEAVE_INTERNAL_TOKEN (or --internal-token-file); "
        "`cleave up` and docker-compose.yml do this",
    )


def api_key_auth(api_keys: ApiKeys | str | None) -> MetadataAuth | None:
    """The check on the gateway's public gRPC service (None: no API key, calls open)."""
    if api_keys is None:
        return None
    if isinstance(api_keys, str):
        api_keys = ApiKeys((api_keys,))
    return MetadataAuth(
        AUTHORIZATION_KEY, api_keys.accepted, "an API key",
        "send 'authorization: Bearer <key>' with the gateway's --api-key (GatewayClient(api_key=...))",
    )


def call_metadata(internal_token: str | None = None, api_key: str | None = None) -> tuple[tuple[str, str], ...]:
    """The metadata a channel adds to every call for these secrets (unset ones add nothing)."""
    pairs = []
    if internal_token is not None:
        pairs.append((INTERNAL_TOKEN_KEY, internal_token))
    if api_key is not None:
        pairs.append((AUTHORIZATION_KEY, bearer(api_key)))
    return tuple(pairs)
