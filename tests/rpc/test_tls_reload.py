"""Servers follow their certificate files (`cleave.tls_reload`): after a rotation new
connections get the new pair (and, with mutual TLS, are checked against the new CA) with no
restart; a rotation half done (a certificate without its key) leaves the old pair served.
Real gRPC and asyncio TLS servers on loopback, checked as every check interval were over."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import ssl
from pathlib import Path

import pytest

from cleave import tls_reload
from cleave.rpc.client import tls_credentials
from cleave.tls import TlsConfig
from tests.rpc.test_tls import health, serving


@pytest.fixture(autouse=True)
def every_handshake_checks(monkeypatch):
    monkeypatch.setattr(tls_reload, "CHECK_INTERVAL_S", 0.0)


@pytest.fixture
def renewed(stranger) -> TlsConfig:
    """The files a rotation brings: a new CA, certificate and key."""
    return stranger


def replace(target: Path, source: Path) -> None:
    """Put `source`'s bytes at `target` as a rotation does: a new file renamed over it."""
    staged = target.with_name(f".{target.name}.new")
    staged.write_bytes(source.read_bytes())
    os.replace(staged, target)


def copy_of(tls: TlsConfig, directory: Path) -> TlsConfig:
    """The files as they are now, under `directory` (a rotation overwrites the originals)."""
    directory.mkdir()
    paths = [directory / path.name for path in (tls.cert_file, tls.key_file, tls.ca_file)]
    for copy, path in zip(paths, (tls.cert_file, tls.key_file, tls.ca_file)):
        copy.write_bytes(path.read_bytes())
    return TlsConfig(*paths)


def rotate(tls: TlsConfig, renewed: TlsConfig, *, key: bool = True) -> None:
    replace(tls.cert_file, renewed.cert_file)
    replace(tls.ca_file, renewed.ca_file)
    if key:
        replace(tls.key_file, renewed.key_file)


@pytest.mark.parametrize("mutual", [False, True])
async def test_a_grpc_server_serves_the_rotated_pair_to_new_connections(tls, renewed, mutual):
    async with serving(tls, mutual=mutual) as address:
        assert await health(address, tls_credentials(tls)) == "SERVING"
        rotate(tls, renewed)
        # a client of the new stack: the server shows the new certificate and, with mutual
        # TLS, takes the client's certificate of the new CA
        assert await health(address, tls_credentials(renewed)) == "SERVING"
        assert await health(address, tls_credentials(tls)) == "SERVING"  # the stack's own files, as rotated


async def test_a_grpc_server_keeps_its_pair_until_the_rotation_is_whole(tls, renewed, tmp_path):
    old = copy_of(tls, tmp_path / "old")
    async with serving(tls, mutual=False) as address:
        rotate(tls, renewed, key=False)  # the new certificate beside the old key: does not load
        assert await health(address, tls_credentials(old)) == "SERVING"  # checked, refused, old pair kept
        assert await health(address, tls_credentials(renewed)) == "UNAVAILABLE"
        replace(tls.key_file, renewed.key_file)
        assert await health(address, tls_credentials(renewed)) == "SERVING"
        assert await health(address, tls_credentials(old)) == "UNAVAILABLE"  # the old CA did not sign it


def digest(certificate: bytes) -> str:
    return hashlib.sha256(certificate).hexdigest()


def pem_digest(path: Path) -> str:
    return digest(ssl.PEM_cert_to_DER_cert(path.read_text()))


async def served_certificate(port: int) -> str:
    """The digest of the certificate a TLS server on loopback shows (not checked)."""
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    reader, writer = await asyncio.open_connection("127.0.0.1", port, ssl=context)
    try:
        return digest(writer.get_extra_info("ssl_object").getpeercert(binary_form=True))
    finally:
        writer.close()
        with contextlib.suppress(ssl.SSLError, ConnectionError):
            await writer.wait_closed()


@contextlib.asynccontextmanager
async def asyncio_tls_server(tls: TlsConfig):
    """An asyncio TLS server as the HTTP API and bulk KV endpoints run one; yields its port."""

    async def answer(reader, writer):  # noqa: ANN001
        writer.close()

    server = await asyncio.start_server(answer, "127.0.0.1", 0, ssl=tls.server_context(mutual=False))
    try:
        yield server.sockets[0].getsockname()[1]
    finally:
        server.close()
        await server.wait_closed()


async def test_an_asyncio_server_shakes_hands_with_the_current_files(tls, renewed):
    first = pem_digest(tls.cert_file)
    async with asyncio_tls_server(tls) as port:
        assert await served_certificate(port) == first
        rotate(tls, renewed, key=False)
        assert await served_certificate(port) == first  # without its key the new certificate waits
        replace(tls.key_file, renewed.key_file)
        assert await served_certificate(port) == pem_digest(renewed.cert_file)


def test_files_are_checked_at_most_once_an_interval(tls, renewed, tmp_path):
    files = tls_reload.CertificateFiles(tls, check_interval_s=3600.0)
    rotate(tls, renewed)
    assert files.changed(mutual=False) is None  # the next check is an hour away
    files = tls_reload.CertificateFiles(tls, check_interval_s=0.0)
    assert files.changed(mutual=False) is None  # nothing changed since it first read them
    rotate(tls, copy_of(renewed, tmp_path / "again"))  # the same bytes, new files
    taken = files.changed(mutual=False)
    assert taken is not None and taken[0].cert == renewed.cert_file.read_bytes()
    assert files.changed(mutual=False) is None  # taken once
