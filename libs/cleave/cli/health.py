"""`cleave health ADDRESS [--service NAME]`: exit 0 when the service reports SERVING.

Used by container health checks, so it imports only grpc (starts in well under a second). A
service that serves TLS is checked over TLS: `--tls-ca-file` (and, for prefill, decode and the
kvstore, which ask their clients for a certificate, `--tls-cert-file` / `--tls-key-file`), read
from CLEAVE_TLS_* like the services' own flags, so a container's check needs no flag.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from cleave.tls import CA_FLAG, CERT_FLAG, KEY_FLAG

EXIT_SERVING = 0
EXIT_NOT_SERVING = 1
EXIT_UNREACHABLE = 2


def check(address: str, service: str = "", timeout_s: float = 3.0,
          credentials: grpc.ChannelCredentials | None = None) -> tuple[int, str]:
    """Ask `address` for the health of `service` ("" = the whole server), over TLS with
    `credentials`.

    Returns (exit code, status text): SERVING -> 0, any other reported status -> 1,
    unreachable or not answering in time -> 2.
    """
    with (grpc.insecure_channel(address) if credentials is None
          else grpc.secure_channel(address, credentials)) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            response = stub.Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout_s
            )
        except grpc.RpcError as error:
            return EXIT_UNREACHABLE, f"{error.code().name}: {error.details()}"
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)
    return (EXIT_SERVING if status == "SERVING" else EXIT_NOT_SERVING), status


def _credentials(ca_file: Path | None, cert_file: Path | None, key_file: Path | None) -> grpc.ChannelCredentials | None:
    """TLS credentials of the given files (None: none given, plain text)."""
    if ca_file is None and cert_file is None:
        return None
    if (cert_file is None) != (key_file is None):
        raise SystemExit(f"{CERT_FLAG} and {KEY_FLAG} go together")
    read = lambda path: None if path is None else Path(path).read_bytes()  # noqa: E731
    return grpc.ssl_channel_credentials(root_certificates=read(ca_file), private_key=read(key_file),
                                        certificate_chain=read(cert_file))


def run(args: argparse.Namespace) -> int:
    credentials = _credentials(args.tls_ca_file, args.tls_cert_file, args.tls_key_file)
    code, status = check(args.address, args.service, args.timeout, credentials)
    print(f"{args.address} {args.service or '(server)'}: {status}")
    return code


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "health",
        help="check a service's gRPC health (exit 0 when SERVING)",
        description=__doc__.splitlines()[0],
    )
    parser.add_argument("address", help="host:port of the service")
    parser.add_argument(
        "--service", default="", help="service name, e.g. cleave.v1.Decode (default: whole server)"
    )
    parser.add_argument("--timeout", type=float, default=3.0, help="seconds to wait (default 3)")
    for flag, what in ((CA_FLAG, "CA to check a TLS server against"),
                       (CERT_FLAG, "client certificate, for a server that asks for one"),
                       (KEY_FLAG, "the client certificate's key")):
        env = "CLEAVE_" + flag.lstrip("-").upper().replace("-", "_")  # as the services read it (cleave.config)
        parser.add_argument(flag, type=Path, default=os.environ.get(env) or None, help=f"{what} (env {env})")
    parser.set_defaults(handler=run)
