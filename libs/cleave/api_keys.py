"""API keys: the gateway's bearer secrets, and the tenants they name.

A gateway takes one key or several (`ApiKeys`: `--api-key`, `--api-key-file`); a caller
sends one as `Authorization: Bearer <key>` (gRPC metadata `authorization`). With several,
each key is a tenant: `key_tag` names it by a digest that does not give the key away, and
its requests share cached prompt prefixes only with each other (`services.gateway.tenants`).
A sent secret is looked up by its SHA-256 digest among the digests of the accepted ones
(`secret_digest`): one lookup however many keys there are, and how far two digests agree
tells nothing of the secrets behind them.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field


def bearer(api_key: str) -> str:
    """The `Authorization` value that carries `api_key`."""
    return f"Bearer {api_key}"


def secret_digest(value: str) -> bytes:
    """What a secret is looked up by (surrogatepass: aiohttp decodes header bytes that are
    not UTF-8 to lone surrogates)."""
    return hashlib.sha256(value.encode("utf-8", "surrogatepass")).digest()


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
    # the digest of each key's `Authorization` value -> the key's tag
    _tenants: dict[bytes, str] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.keys:
            raise ValueError("give at least one API key")
        for position, key in enumerate(self.keys):
            if not key or any(character in key for character in "\r\n\0"):
                raise ValueError(f"API key {position + 1} is empty or holds a line break or NUL")
        if len(set(self.keys)) != len(self.keys):
            raise ValueError("an API key is given twice")
        object.__setattr__(self, "_tenants", {secret_digest(bearer(key)): key_tag(key) for key in self.keys})

    @property
    def accepted(self) -> frozenset[bytes]:
        """The digests of the `Authorization` values the keys are sent as."""
        return frozenset(self._tenants)

    @property
    def isolates(self) -> bool:
        """Whether the keys are tenants of their own (more than one key)."""
        return len(self.keys) > 1

    def tenant(self, authorization: str | None) -> str | None:
        """The `key_tag` of the key an `Authorization` value carries (None: none of them)."""
        return None if authorization is None else self._tenants.get(secret_digest(authorization))
