"""Certificates for TLS tests: a stack's (`cleave tls-certs`) and a stranger's, signed by
another CA, written once per test into its tmp_path."""

from __future__ import annotations

from pathlib import Path

from cleave.cli.tls_certs import StackCertificates, write_certificates
from cleave.tls import TlsConfig


def stack_tls(directory: Path, hosts: tuple[str, ...] = ()) -> TlsConfig:
    """A fresh CA and certificate under `directory`, as a process's TLS configuration."""
    files: StackCertificates = write_certificates(directory, hosts)
    return TlsConfig(files.cert_file, files.key_file, files.ca_file)
