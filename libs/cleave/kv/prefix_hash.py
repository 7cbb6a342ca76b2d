"""Chained content hashes of full KV blocks, identical in every process and on every machine.

Block `i` of a token sequence covers tokens `[i * block_size, (i + 1) * block_size)`. Its
hash covers those tokens *and* the hash of block `i - 1`, so equal hashes mean equal whole
prefixes, which is what makes a cached block reusable. Only full blocks are hashed: a
partially filled block is still being written.

The namespace carries whatever else decides the bytes of a block's KV (model, dtype, block
size, cache layout) so two models never share hashes; build it with `kv_namespace`.

Encoding (version 1), fed to SHA-256 in this order:
    b"cleave.kv.block/v1"
    u32le(len(namespace)) || namespace
    b"\\x00"                      when there is no parent (first block), or
    b"\\x01" || parent            (the parent's 32-byte digest)
    u32le(num_tokens) || u32le(token_0) || ... || u32le(token_{n-1})
The prefill engine and the KV block store (services/kvstore) call these same functions;
changing the encoding means bumping the version tag.

A cache salt (a request's `cache_salt`) starts a chain of its own: its first block's parent
is `salt_root(salt)` instead of none,
    SHA-256(b"cleave.kv.salt/v1" || salt as UTF-8)
so a salted prompt's blocks match only blocks of prompts sent with the same salt, and never
an unsalted prompt's (whose first block has no parent). Requests of one tenant that share a
salt share cached prefixes; nobody else can detect them (by the prompt tokens a response
reports cached, or by its time to first token).
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Mapping, Sequence

BlockHash = bytes
"""A 32-byte SHA-256 digest naming one full block and its whole prefix."""

HASH_SIZE = 32
_DOMAIN_TAG = b"cleave.kv.block/v1"
_SALT_TAG = b"cleave.kv.salt/v1"
_MAX_TOKEN_ID = 2**32 - 1


def hash_block(parent: BlockHash | None, token_ids: Sequence[int], namespace: bytes = b"") -> BlockHash:
    """Hash one block of tokens chained onto its parent block's hash (None for block 0)."""
    digest = hashlib.sha256(_DOMAIN_TAG)
    digest.update(len(namespace).to_bytes(4, "little"))
    digest.update(namespace)
    if parent is None:
        digest.update(b"\x00")
    else:
        if len(parent) != HASH_SIZE:
            raise ValueError(f"parent hash must be {HASH_SIZE} bytes, got {len(parent)}")
        digest.update(b"\x01")
        digest.update(parent)
    num_tokens = len(token_ids)
    digest.update(num_tokens.to_bytes(4, "little"))
    try:
        digest.update(struct.pack(f"<{num_tokens}I", *token_ids))
    except struct.error as exc:
        raise ValueError(f"token ids must be integers in [0, {_MAX_TOKEN_ID}]: {exc}") from None
    return digest.digest()


def salt_root(cache_salt: str) -> BlockHash | None:
    """The parent of a salted chain's first block (None without a salt: an unsalted chain)."""
    if not cache_salt:
        return None
    return hashlib.sha256(_SALT_TAG + cache_salt.encode("utf-8")).digest()


def block_hashes(
    token_ids: Sequence[int],
    block_size: int,
    namespace: bytes = b"",
    parent: BlockHash | None = None,
) -> list[BlockHash]:
    """Chained hashes of every full block of `token_ids` (a trailing partial block is skipped).

    `parent` continues an existing chain: pass the hash of the block just before
    `token_ids[0]` to hash only the new blocks of a growing sequence, or a prompt's
    `salt_root` to hash it from its start under its salt.
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    hashes: list[BlockHash] = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_block(parent, token_ids[start : start + block_size], namespace)
        hashes.append(parent)
    return hashes


def kv_namespace(
    model: str,
    dtype: str,
    block_size: int,
    layout: str = "layers,kv,blocks,block_size,kv_heads,head_dim",
    extra: Mapping[str, str] | None = None,
) -> bytes:
    """Canonical namespace bytes for one model's KV: sorted `key=value` lines, UTF-8.

    `model` should identify the weights (name plus revision or checksum); `extra` adds any
    other identity (tensor-parallel rank layout, adapter id, ...).
    """
    fields = {"model": model, "dtype": dtype, "block_size": str(block_size), "layout": layout}
    for key, value in (extra or {}).items():
        if key in fields:
            raise ValueError(f"extra key {key!r} collides with a built-in namespace field")
        fields[key] = value
    for key, value in fields.items():
        if "\n" in key or "=" in key or "\n" in value:
            raise ValueError(f"namespace field {key!r} must not contain newlines or '=' in its key")
    return "\n".join(f"{key}={fields[key]}" for key in sorted(fields)).encode("utf-8")
