"""Tenants of a gateway with several API keys: each key's requests share cached prompt
prefixes only with each other.

With one key (or none) every caller is one tenant and a request's `cache_salt` reaches the
workers as sent. With several (`cleave.api_keys.ApiKeys.isolates`), the salt it reaches
them with is a digest of its key's tag and the salt it sent, empty or not: two keys never
share a salt, so no tenant's prompt is a prefix-cache hit, or a sooner first token, for
another (`cleave.kv.prefix_hash.salt_root`), while a tenant's own salts still split its
share of the cache further. With `--tenant-metrics` the gateway's metrics count each
tenant's finished requests and their tokens (`cleave:tenant_requests_total`,
`cleave:tenant_tokens_total{kind}`).
"""

from __future__ import annotations

import hashlib
from collections.abc import AsyncIterator
from dataclasses import replace

from services.gateway.backend import BackendLayer, GatewayBackend, GenerateChunk, GenerateSpec

_TAG = b"cleave.tenant-salt/v1\x00"


def tenant_salt(tenant: str, cache_salt: str) -> str:
    """The cache salt a request of `tenant` (a `key_tag`) that sent `cache_salt` runs with."""
    return hashlib.sha256(_TAG + tenant.encode() + b"\x00" + cache_salt.encode()).hexdigest()


def for_tenant(spec: GenerateSpec, tenant: str | None) -> GenerateSpec:
    """`spec` as `tenant`'s request: its cache salt scoped to the tenant, which the gateway's
    per-tenant usage counts it under (None: `spec` as it is)."""
    if tenant is None:
        return spec
    salted = replace(spec.sampling, cache_salt=tenant_salt(tenant, spec.sampling.cache_salt))
    return replace(spec, sampling=salted, tenant=tenant)


class TenantBackend(BackendLayer):
    """The gateway's backend as one tenant's requests reach it (`for_tenant` on each)."""

    def __init__(self, backend: GatewayBackend, tenant: str) -> None:
        super().__init__(backend)
        self.tenant = tenant

    def generate(self, spec: GenerateSpec) -> AsyncIterator[GenerateChunk]:
        return self.backend.generate(for_tenant(spec, self.tenant))
