"""Tenants of a gateway with several API keys: each key's requests share cached prompt
prefixes only with each other.

With one key (or none) every caller is one tenant and a request's `cache_salt` reaches the
workers as sent. With several (`cleave.api_keys.ApiKeys.isolates`), the salt it reaches
them with is a digest of its key's tag and the salt it sent, empty or not: two keys never
share a salt, so no tenant's prompt is a prefix-cache hit, or a sooner first token, for
another (`cleave.kv.prefix_hash.salt_root`), while a tenant's own salts still split its
share of the cache further. With `--tenant-metrics` the gateway's metrics count each
tenant's finished requests and their tokens (`cleave:tenant_requests_total`,
`cleave:tenant_tokens_total{kind}`). A key with a priority floor (`priority>=N` in the key
file) has its requests run at N or a less urgent priority. Request ids a client chooses
(gRPC) are its tenant's own: another tenant's request of the same id is a different request
(`scoped_request_id`).
"""

from __future__ import annotations

import hashlib
from collections.abc import AsyncIterator
from dataclasses import replace

import structlog

from services.gateway.backend import BackendLayer, GatewayBackend, GenerateChunk, GenerateSpec

log = structlog.get_logger(__name__)

_TAG = b"cleave.tenant-salt/v1\x00"


def tenant_salt(tenant: str, cache_salt: str) -> str:
    """The cache salt a request of `tenant` (a `key_tag`) that sent `cache_salt` runs with."""
    return hashlib.sha256(_TAG + tenant.encode() + b"\x00" + cache_salt.encode()).hexdigest()


def scoped_request_id(tenant: str | None, request_id: str) -> str:
    """The id a request whose id the client chose (gRPC) runs under inside the gateway: with
    several keys, prefixed with its tenant's tag, so equal ids of two tenants never meet (one
    tenant cannot learn that another runs an id, or block it, by starting the same one).
    With one key or none every caller is one tenant: the id as sent."""
    return request_id if tenant is None else f"{tenant}/{request_id}"


def for_tenant(spec: GenerateSpec, tenant: str | None, priority_floor: int | None = None) -> GenerateSpec:
    """`spec` as `tenant`'s request: its cache salt scoped to the tenant, which the gateway's
    per-tenant usage counts it under, and its priority at least `priority_floor` (the key's,
    `cleave.api_keys.ApiKeys.priority_floor`). A `tenant` of None: `spec` as it is."""
    if tenant is None:
        return spec
    sampling = spec.sampling
    priority = sampling.priority if priority_floor is None else max(sampling.priority, priority_floor)
    if priority != sampling.priority:
        log.info("priority raised to the key's floor", request_id=spec.request_id, asked=sampling.priority,
                 priority=priority)
    salted = replace(sampling, cache_salt=tenant_salt(tenant, sampling.cache_salt), priority=priority)
    return replace(spec, sampling=salted, tenant=tenant)


class TenantBackend(BackendLayer):
    """The gateway's backend as one tenant's requests reach it (`for_tenant` on each)."""

    def __init__(self, backend: GatewayBackend, tenant: str, priority_floor: int | None = None) -> None:
        super().__init__(backend)
        self.tenant = tenant
        self.priority_floor = priority_floor

    def generate(self, spec: GenerateSpec) -> AsyncIterator[GenerateChunk]:
        return self.backend.generate(for_tenant(spec, self.tenant, self.priority_floor))
