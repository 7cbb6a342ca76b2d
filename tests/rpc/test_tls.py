"""TLS on the gRPC servers and channels (`cleave.tls`): who gets a connection, and the flags'
errors. Real servers on loopback, real grpcio clients."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from cleave.config import RpcConfig
from cleave.rpc.client import aio_channel, tls_credentials
from cleave.rpc.server import serve
from cleave.tls import TlsConfig, TlsConfigError, server_name
from tests.tls_files import stack_tls


async def health(address: str, credentials: grpc.ChannelCredentials | None) -> str:
    """The server's health over a channel with `credentials` (plain text without), or the
    status code name of the failed call."""
    async with aio_channel(address, credentials=credentials) as channel:
        try:
            response = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
        except grpc.aio.AioRpcError as error:
            return error.code().name
    return health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)


@contextlib.asynccontextmanager
async def serving(tls: TlsConfig, mutual: bool, host: str = "127.0.0.1") -> AsyncIterator[str]:
    """A health-only server with `tls` on `host`, SERVING; yields its address."""
    server = await serve([], f"{host}:0", RpcConfig(tls=tls, mutual_tls=mutual), handle_signals=False)
    try:
        await server.set_ready()
        yield f"{host}:{server.port}"
    finally:
        await server.drain(0)


@pytest.fixture
async def internal_server(tls):
    """A server as prefill, decode and the kvstore run it: TLS, clients must present a certificate."""
    async with serving(tls, mutual=True) as address:
        yield address


@pytest.fixture
async def public_server(tls):
    """A server as the gateway runs it: TLS, no client certificate asked."""
    async with serving(tls, mutual=False) as address:
        yield address


async def test_an_internal_server_takes_only_clients_with_a_certificate_of_its_ca(internal_server, tls, stranger):
    address = internal_server
    assert await health(address, tls_credentials(tls)) == "SERVING"
    ca_only = grpc.ssl_channel_credentials(tls.ca_file.read_bytes())
    assert await health(address, ca_only) == "UNAVAILABLE"  # no client certificate: no connection
    # a client certificate of another CA, the server checked against its own CA
    foreign = grpc.ssl_channel_credentials(tls.ca_file.read_bytes(), stranger.key_file.read_bytes(),
                                           stranger.cert_file.read_bytes())
    assert await health(address, foreign) == "UNAVAILABLE"
    assert await health(address, None) == "UNAVAILABLE"  # plain text to a TLS port


async def test_a_client_checks_the_server_against_its_ca(internal_server, stranger):
    # the stranger's CA did not sign the server's certificate: the client refuses the server
    assert await health(internal_server, tls_credentials(stranger)) == "UNAVAILABLE"


async def test_the_server_certificate_must_name_the_host_dialled(tmp_path):
    only_localhost = stack_tls(tmp_path / "narrow")
    async with serving(only_localhost, mutual=True, host="127.0.0.2") as address:
        # 127.0.0.2 is loopback too, but the certificate names 127.0.0.1, ::1, localhost and the host name
        assert await health(address, tls_credentials(only_localhost)) == "UNAVAILABLE"
    named = stack_tls(tmp_path / "named", hosts=("127.0.0.2",))
    async with serving(named, mutual=True, host="127.0.0.2") as address:
        assert await health(address, tls_credentials(named)) == "SERVING"


async def test_a_public_server_asks_no_client_certificate(public_server, tls):
    address = public_server
    assert await health(address, grpc.ssl_channel_credentials(tls.ca_file.read_bytes())) == "SERVING"
    assert await health(address, tls_credentials(tls)) == "SERVING"
    assert await health(address, None) == "UNAVAILABLE"


def test_no_files_means_plain_text():
    assert TlsConfig.from_files(None, None, None) is None
    assert tls_credentials(None) is None


def test_the_flags_errors_name_the_flag(tls, stranger, tmp_path):
    with pytest.raises(TlsConfigError, match="--tls-key-file is missing"):
        TlsConfig.from_files(tls.cert_file, None, None)
    with pytest.raises(TlsConfigError, match="--tls-cert-file is missing"):
        TlsConfig.from_files(None, tls.key_file, tls.ca_file)
    with pytest.raises(TlsConfigError, match="--tls-ca-file needs --tls-cert-file and --tls-key-file"):
        TlsConfig.from_files(None, None, tls.ca_file)
    with pytest.raises(TlsConfigError, match=r"--tls-ca-file: .*missing\.pem is not a readable file"):
        TlsConfig.from_files(tls.cert_file, tls.key_file, tmp_path / "missing.pem")
    with pytest.raises(TlsConfigError, match="not a PEM certificate and its key"):
        TlsConfig.from_files(tls.cert_file, stranger.key_file, None)  # the key of another certificate
    not_pem = tmp_path / "ca.txt"
    not_pem.write_text("hello")
    with pytest.raises(TlsConfigError, match="not a PEM certificate"):
        TlsConfig.from_files(tls.cert_file, tls.key_file, not_pem)
    assert TlsConfig.from_files(tls.cert_file, tls.key_file, tls.ca_file) == tls


@pytest.mark.parametrize(("address", "host"), [("127.0.0.1:50051", "127.0.0.1"), ("decode:50071", "decode"),
                                               ("[::1]:8000", "::1")])
def test_server_name_is_the_host_dialled(address, host):
    assert server_name(address) == host
