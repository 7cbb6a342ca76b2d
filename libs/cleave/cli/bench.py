"""`cleave bench ...`: benchmarks run from the command line (`cleave bench serve`)."""

from __future__ import annotations

import argparse

from cleave.cli import bench_serve


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("bench", help="benchmark a running server", description=__doc__.splitlines()[0])
    benchmarks = parser.add_subparsers(dest="benchmark", metavar="BENCHMARK")
    bench_serve.add_parser(benchmarks)

    def usage(args: argparse.Namespace) -> int:
        parser.print_help()
        return 2

    parser.set_defaults(handler=usage)
