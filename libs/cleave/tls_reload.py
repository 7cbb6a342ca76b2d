"""Certificates taken again when their files change: what a process serves TLS with follows
its `--tls-cert-file`, `--tls-key-file` and `--tls-ca-file` without a restart.

Each server (a gRPC port, the gateway's HTTP API, a bulk KV endpoint) checks the files' stat
(modification time, size, inode) at most once a second, as a connection's handshake begins,
and from then on shakes hands with the new pair and, with mutual TLS, checks clients against
the new CA. A change is taken only once the files load together (a certificate and its key,
read once and checked on a scratch context), so a rotation that writes one file before the
other, or a half-written file, leaves the server on the old pair until the set is whole
again. Connections already open keep theirs. What a process presents as a client (gRPC
channels to other services, opened at start-up) does not follow: those channels keep the
pair they were opened with until the process restarts; bulk KV connections, opened per
transfer, read the files each time.
"""

from __future__ import annotations

import os
import ssl
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import grpc
import structlog

if TYPE_CHECKING:
    from cleave.tls import TlsConfig

log = structlog.get_logger(__name__)

CHECK_INTERVAL_S = 1.0  # the files' stat is read at most this often per server


@dataclass(frozen=True)
class Pems:
    """A certificate, its key and the peers' CA (None: none given), as read together."""

    cert: bytes
    key: bytes
    ca: bytes | None

    def server_context(self, mutual: bool) -> ssl.SSLContext:
        """A listening socket's context with this pair (`mutual`, with a CA: clients must
        present a certificate it signed). Raises ssl.SSLError / OSError when the files do not
        make one (a key of another certificate, not PEM)."""
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        with tempfile.TemporaryDirectory(prefix="cleave-tls-") as directory:  # 0700: the key stays private
            cert, key = Path(directory, "cert.pem"), Path(directory, "key.pem")
            cert.write_bytes(self.cert)
            key.write_bytes(self.key)
            context.load_cert_chain(cert, key)
        if mutual and self.ca is not None:
            context.load_verify_locations(cadata=self.ca.decode("ascii", "replace"))
            context.verify_mode = ssl.CERT_REQUIRED
        return context

    def grpc_configuration(self, mutual: bool):  # noqa: ANN201 (grpc.ServerCertificateConfiguration)
        return grpc.ssl_server_certificate_configuration([(self.key, self.cert)],
                                                         root_certificates=self.ca if mutual else None)


class CertificateFiles:
    """A TLS configuration's files, watched: `changed()` gives their new contents once they
    changed and load together (see the module docstring). Safe to call from any thread
    (gRPC calls it from its own)."""

    def __init__(self, tls: TlsConfig, check_interval_s: float | None = None) -> None:
        self.tls = tls
        self.check_interval_s = CHECK_INTERVAL_S if check_interval_s is None else check_interval_s
        self._lock = threading.Lock()
        self._stamp = self._fingerprint()
        self._next_check = time.monotonic() + self.check_interval_s

    def _paths(self) -> tuple[Path, ...]:
        tls = self.tls
        return (tls.cert_file, tls.key_file) if tls.ca_file is None else (tls.cert_file, tls.key_file, tls.ca_file)

    def _fingerprint(self) -> tuple:
        stamps = []
        for path in self._paths():
            try:
                stat = os.stat(path)
            except OSError:
                stamps.append(None)  # gone for now (a rotation replacing it): changed, unreadable
                continue
            stamps.append((stat.st_mtime_ns, stat.st_size, stat.st_ino))
        return tuple(stamps)

    def read(self) -> Pems:
        tls = self.tls
        return Pems(tls.cert_file.read_bytes(), tls.key_file.read_bytes(),
                    None if tls.ca_file is None else tls.ca_file.read_bytes())

    def changed(self, mutual: bool) -> tuple[Pems, ssl.SSLContext] | None:
        """The files' new contents and a server context of them, when a file changed since
        they were last taken and the set loads; else None (also between checks)."""
        with self._lock:
            now = time.monotonic()
            if now < self._next_check:
                return None
            self._next_check = now + self.check_interval_s
            stamp = self._fingerprint()
            if stamp == self._stamp:
                return None
            try:
                pems = self.read()
                context = pems.server_context(mutual)
            except (OSError, ssl.SSLError, ValueError) as error:
                log.warning("tls_files_not_taken", cert_file=str(self.tls.cert_file), reason=str(error),
                            detail="still serving the earlier certificate; checked again within a second")
                return None  # the stamp stays: the next check tries again
            self._stamp = stamp
            log.info("tls_files_taken", cert_file=str(self.tls.cert_file), key_file=str(self.tls.key_file),
                     ca_file=None if self.tls.ca_file is None else str(self.tls.ca_file))
            return pems, context


class ReloadingServerContext(ssl.SSLContext):
    """A listening socket's ssl context that shakes hands with the current files' pair: each
    connection's TLS object comes from the context of the latest files that loaded (asyncio
    servers call `wrap_bio` per connection, before its handshake)."""

    def __new__(cls, files: CertificateFiles, mutual: bool) -> ReloadingServerContext:  # noqa: ARG003
        return super().__new__(cls, ssl.PROTOCOL_TLS_SERVER)

    def __init__(self, files: CertificateFiles, mutual: bool) -> None:
        self._files = files
        self._mutual = mutual
        self._current = files.read().server_context(mutual)

    @property
    def current(self) -> ssl.SSLContext:
        """The context new connections get (the latest files' that loaded)."""
        taken = self._files.changed(self._mutual)
        if taken is not None:
            self._current = taken[1]
        return self._current

    def wrap_bio(self, *args, **kwargs) -> ssl.SSLObject:  # type: ignore[override]
        return self.current.wrap_bio(*args, **kwargs)

    def wrap_socket(self, *args, **kwargs) -> ssl.SSLSocket:  # type: ignore[override]
        return self.current.wrap_socket(*args, **kwargs)


def reloading_server_credentials(files: CertificateFiles, mutual: bool) -> grpc.ServerCredentials:
    """gRPC server credentials that take the files again when they change (gRPC asks before
    each handshake)."""
    asks = mutual and files.tls.ca_file is not None

    def fetch():  # noqa: ANN202 (grpc.ServerCertificateConfiguration | None)
        try:
            taken = files.changed(asks)
        except Exception as error:  # noqa: BLE001 (an exception here would fail the handshake)
            log.warning("tls_files_not_taken", cert_file=str(files.tls.cert_file), reason=str(error))
            return None
        return None if taken is None else taken[0].grpc_configuration(asks)

    return grpc.dynamic_ssl_server_credentials(files.read().grpc_configuration(asks), fetch,
                                               require_client_authentication=asks)
