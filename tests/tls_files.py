"""Certificates for TLS tests: a stack's, as `cleave tls-certs` writes them."""

from __future__ import annotations

from pathlib import Path

from cleave.cli.tls_certs import write_certificates
from cleave.tls import TlsConfig


def stack_tls(directory: Path, hosts: tuple[str, ...] = ()) -> TlsConfig:
    """A fresh CA and certificate under `directory`, as a process's TLS configuration."""
    return write_certificates(directory, hosts)
