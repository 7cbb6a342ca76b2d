"""API keys: the gateway's bearer secrets, and the tenants they name.

A gateway takes one key or several (`ApiKeys`: `--api-key`, `--api-key-file`); a caller
sends one as `Authorization: Bearer <key>` (gRPC metadata `authorization`). With several,
each key is a tenant: `key_tag` names it by a digest that does not give the key away, and
its requests share cached prompt prefixes only with each other (`services.gateway.tenants`).
A sent secret is looked up by its SHA-256 digest among the digests of the accepted ones
(`secret_digest`): one lookup however many keys there are, and how far two digests agree
tells nothing of the secrets behind them.

With `--scheduling-policy priority`, a key may carry a priority floor (`priority>=N` after it
on its line of the key file): the most urgent priority its requests run at. One asking for a
more urgent value, or for none (0) under a floor above 0, runs at the floor
(`services.gateway.tenants.for_tenant`), so a batch tenant's key cannot jump ahead of an
interactive one's requests however it sets `priority`.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass, field

from cleave.generation.sampling_params import PRIORITY_MAX, PRIORITY_MIN


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

    `priority_floors` maps a key to the most urgent priority its requests run at (see the
    module docstring); only keys that are tenants (two or more keys) take one.

    Raises ValueError for no key, an empty one, one with a line break or NUL (it could not
    travel in a header), a repeated one, or a floor for a key not given, out of the int32
    range, or with a single key.
    """

    keys: tuple[str, ...] = field(repr=False)
    priority_floors: Mapping[str, int] = field(default_factory=dict, repr=False)
    # the digest of each key's `Authorization` value -> the key's tag
    _tenants: dict[bytes, str] = field(init=False, repr=False, compare=False)
    _floors: dict[str, int] = field(init=False, repr=False, compare=False)  # a key's tag -> its floor

    def __post_init__(self) -> None:
        if not self.keys:
            raise ValueError("give at least one API key")
        for position, key in enumerate(self.keys):
            if not key or any(character in key for character in "\r\n\0"):
                raise ValueError(f"API key {position + 1} is empty or holds a line break or NUL")
        if len(set(self.keys)) != len(self.keys):
            raise ValueError("an API key is given twice")
        object.__setattr__(self, "_tenants", {secret_digest(bearer(key)): key_tag(key) for key in self.keys})
        object.__setattr__(self, "_floors", self._checked_floors())

    def _checked_floors(self) -> dict[str, int]:
        floors = {}
        for key, floor in self.priority_floors.items():
            if key not in self.keys:  # the message names the key's tag, never the key
                raise ValueError(f"a priority floor is given for a key that is not one of the keys ({key_tag(key)})")
            if isinstance(floor, bool) or not isinstance(floor, int) or not PRIORITY_MIN <= floor <= PRIORITY_MAX:
                raise ValueError(f"a priority floor must be an integer in [{PRIORITY_MIN}, {PRIORITY_MAX}], "
                                 f"got {floor!r}")
            floors[key_tag(key)] = floor
        if floors and not self.isolates:
            raise ValueError("a priority floor needs two or more keys: with one, every caller is one tenant")
        return floors

    @property
    def accepted(self) -> frozenset[bytes]:
        """The digests of the `Authorization` values the keys are sent as."""
        return frozenset(self._tenants)

    @property
    def isolates(self) -> bool:
        """Whether the keys are tenants of their own (more than one key)."""
        return len(self.keys) > 1

    @property
    def has_priority_floors(self) -> bool:
        """Whether any key carries a priority floor."""
        return bool(self._floors)

    def priority_floor(self, tenant: str) -> int | None:
        """The priority floor of the key whose tag is `tenant` (None: it has none)."""
        return self._floors.get(tenant)

    def tenant(self, authorization: str | None) -> str | None:
        """The `key_tag` of the key an `Authorization` value carries (None: none of them)."""
        return None if authorization is None else self._tenants.get(secret_digest(authorization))
