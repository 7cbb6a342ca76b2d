"""TLS on cleave's sockets: gRPC servers and channels, the gateway's HTTP API, bulk KV connections.

A process holds one certificate and key (`--tls-cert-file`, `--tls-key-file`) and, optionally,
the certificate authority that signed its peers' (`--tls-ca-file`):

- its gRPC server, and the gateway's HTTP API, serve TLS with the pair. Prefill, decode and
  kvstore given a CA also ask every client for a certificate that CA signed (mutual TLS), so
  only holders of a stack certificate open a connection to them at all; the gateway's public
  servers ask for none (their clients authenticate with the API key);
- each call and bulk KV connection it opens to another service checks the server's certificate
  against the CA (without one: the system's roots) and against the host it dialled, and
  presents the pair.

Servers follow the files: a rotated certificate is served to new connections within a second
of its files changing, without a restart (`cleave.tls_reload`). The internal token is still
sent and checked on top. NCCL and CUDA IPC are not encrypted: CUDA IPC stays inside one host,
NCCL runs over the fabric it picks (NVLink, InfiniBand, sockets). `cleave tls-certs DIR`
writes a CA and a certificate for a stack.
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass
from pathlib import Path

import grpc

from cleave.tls_reload import CertificateFiles, ReloadingServerContext, reloading_server_credentials

CERT_FLAG, KEY_FLAG, CA_FLAG = "--tls-cert-file", "--tls-key-file", "--tls-ca-file"


class TlsConfigError(ValueError):
    """TLS flags that do not make a usable configuration; the message names the flag."""


@dataclass(frozen=True)
class TlsConfig:
    """A process's certificate, key and (optional) peer CA, as PEM files."""

    cert_file: Path
    key_file: Path
    ca_file: Path | None = None

    @classmethod
    def from_files(cls, cert_file: Path | None, key_file: Path | None, ca_file: Path | None) -> TlsConfig | None:
        """The configuration the three flags give (None: TLS off), checked by loading it:
        a missing or unreadable file, a key that does not match its certificate or a CA
        without a pair raises TlsConfigError naming the flag."""
        if cert_file is None and key_file is None:
            if ca_file is not None:
                raise TlsConfigError(f"{CA_FLAG} needs {CERT_FLAG} and {KEY_FLAG}: the CA checks the peers of a "
                                     f"process that serves TLS itself")
            return None
        if cert_file is None or key_file is None:
            missing = CERT_FLAG if cert_file is None else KEY_FLAG
            raise TlsConfigError(f"{missing} is missing: TLS needs both {CERT_FLAG} and {KEY_FLAG}")
        config = cls(Path(cert_file), Path(key_file), None if ca_file is None else Path(ca_file))
        for flag, path in ((CERT_FLAG, config.cert_file), (KEY_FLAG, config.key_file), (CA_FLAG, config.ca_file)):
            if path is not None and not path.is_file():
                raise TlsConfigError(f"{flag}: {path} is not a readable file")
        try:
            config.client_context()
        except (ssl.SSLError, OSError) as exc:
            raise TlsConfigError(f"{CERT_FLAG} {config.cert_file} / {KEY_FLAG} {config.key_file}"
                                 f"{'' if ca_file is None else f' / {CA_FLAG} {config.ca_file}'}: "
                                 f"not a PEM certificate and its key ({exc})") from None
        return config

    def _ca(self) -> bytes | None:
        return None if self.ca_file is None else self.ca_file.read_bytes()

    def server_credentials(self, *, mutual: bool) -> grpc.ServerCredentials:
        """A gRPC server's credentials; `mutual` (with a CA): clients must present a
        certificate the CA signed. They follow the files when they change (`cleave.tls_reload`)."""
        return reloading_server_credentials(CertificateFiles(self), mutual)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        """A gRPC channel's credentials: the server checked against the CA, the pair presented."""
        return grpc.ssl_channel_credentials(root_certificates=self._ca(), private_key=self.key_file.read_bytes(),
                                            certificate_chain=self.cert_file.read_bytes())

    def server_context(self, *, mutual: bool) -> ssl.SSLContext:
        """An ssl context for a listening socket (bulk KV endpoint, HTTP API) that follows the
        files when they change (`cleave.tls_reload`)."""
        return ReloadingServerContext(CertificateFiles(self), mutual)

    def client_context(self) -> ssl.SSLContext:
        """An ssl context for a connection this process opens: the server's certificate and
        host name checked, the pair presented."""
        context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=self.ca_file)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        context.load_cert_chain(self.cert_file, self.key_file)
        return context


def server_name(address: str) -> str:
    """The host part of host:port (brackets of an IPv6 literal removed): the name a
    certificate must carry for a connection to `address`."""
    host = address.rpartition(":")[0]
    return host[1:-1] if host.startswith("[") and host.endswith("]") else host
