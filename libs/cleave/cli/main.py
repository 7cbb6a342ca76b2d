"""Entry point of the `cleave` command: finds subcommand modules and dispatches."""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys
from collections.abc import Sequence

import cleave
import cleave.cli


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser with every subcommand module of `cleave.cli` registered."""
    parser = argparse.ArgumentParser(prog="cleave", description=cleave.__doc__)
    parser.add_argument("--version", action="version", version=f"cleave {cleave.__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module_info in sorted(pkgutil.iter_modules(cleave.cli.__path__), key=lambda m: m.name):
        if module_info.name.startswith("_") or module_info.name == "main":
            continue
        module = importlib.import_module(f"cleave.cli.{module_info.name}")
        register = getattr(module, "register", None)
        if register is not None:
            register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    handler = getattr(args, "handler", None)
    if handler is None:
        parser.print_help(sys.stderr)
        return 2
    return int(handler(args))


if __name__ == "__main__":
    sys.exit(main())
