"""API keys: the gateway's bearer secrets, and the tenants they name.

A gateway takes one key or several (`ApiKeys`: `--api-key`, `--api-key-file`); a caller
sends one as `Authorization: Bearer <key>` (gRPC metadata `authorization`). With several,
each key is a tenant: `key_tag` names it by a digest that does not give the key away, and
its requests share cached prompt prefixes only with each other (`services.gateway.tenants`).
Secrets are compared with `hmac.compare_digest`, each accepted value in turn (no early exit
that would tell which one came close).
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable
from dataclasses import dataclass, field


def same_secret(sent: str, expected: str) -> bool:
    # surrogatepass: aiohttp decodes header bytes that are not UTF-8 to lone surrogates
    return hmac.compare_digest(sent.encode("utf-8", "surrogatepass"), expected.encode())


def bearer(api_key: str) -> str:
    """The `Authorization` value that carries `api_key`."""
    return f"Bearer {api_key}"


def bearer_matches(authorization: str | None, api_key: str) -> bool:
    """Whether an `Authorization` header (or metadata value) carries `api_key`."""
    return authorization is not None and same_secret(authorization, bearer(api_key))


def any_secret(sent: str, accepted: Iterable[str]) -> bool:
    """Whether `sent` is one of `accepted`, each compared in constant time."""
    matches = [same_secret(sent, value) for value in accepted]
    return any(matches)


def key_tag(api_key: str) -> str:
    """A tenant's name: 16 hex digits of a digest of its API key (safe to log)."""
    return hashlib.sha256(b"cleave.api-key/v1\x00" + api_key.encode()).hexdigest()[:16]


@dataclass(frozen=True)
class ApiKeys:
    """The API keys a gateway takes: any one authenticates a caller. With more than one,
    each key is a tenant (`isolates`): `tenant` names the key a caller sent.

    Raises ValueError for no key, an empty one, one with a line break or NUL (it could not
    travel in a header) or a repeated one.
    """

    keys: tuple[str, ...] = field(repr=False)

    def __post_init__(self) -> None:
        if not self.keys:
            raise ValueError("give at least one API key")
        for position, key in enumerate(self.keys):
            if not key or any(character in key for character in "\r\n\0"):
                raise ValueError(f"API key {position + 1} is empty or holds a line break or NUL")
        if len(set(self.keys)) != len(self.keys):
            raise ValueError("an API key is given twice")

    @property
    def isolates(self) -> bool:
        """Whether the keys are tenants of their own (more than one key)."""
        return len(self.keys) > 1

    def tenant(self, authorization: str | None) -> str | None:
        """The `key_tag` of the key an `Authorization` value carries (None: none of them)."""
        found = None
        for key in self.keys:  # every key compared: no early exit
            if bearer_matches(authorization, key):
                found = key_tag(key)
        return found
