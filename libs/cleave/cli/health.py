"""`cleave health ADDRESS [--service NAME]`: exit 0 when the service reports SERVING.

Used by container health checks, so it imports only grpc (starts in well under a second).
"""

from __future__ import annotations

import argparse

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

EXIT_SERVING = 0
EXIT_NOT_SERVING = 1
EXIT_UNREACHABLE = 2


def check(address: str, service: str = "", timeout_s: float = 3.0) -> tuple[int, str]:
    """Ask `address` for the health of `service` ("" = the whole server).

    Returns (exit code, status text): SERVING -> 0, any other reported status -> 1,
    unreachable or not answering in time -> 2.
    """
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            response = stub.Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout_s
            )
        except grpc.RpcError as error:
            return EXIT_UNREACHABLE, f"{error.code().name}: {error.details()}"
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)
    return (EXIT_SERVING if status == "SERVING" else EXIT_NOT_SERVING), status


def run(args: argparse.Namespace) -> int:
    code, status = check(args.address, args.service, args.timeout)
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
    parser.set_defaults(handler=run)
