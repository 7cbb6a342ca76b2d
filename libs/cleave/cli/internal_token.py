"""`cleave internal-token PATH`: write the stack's internal token to a file the services read
(`--internal-token-file` / CLEAVE_INTERNAL_TOKEN_FILE), so a stack started from
docker-compose.yml authenticates its internal calls with no secret to set by hand.

The token is CLEAVE_INTERNAL_TOKEN when that is set (an operator's own secret), else the one
already in the file (so restarts keep it), else a new random one. The file is readable by
its owner only.
"""

from __future__ import annotations

import argparse
import os
import secrets
import sys
from pathlib import Path

from cleave.cli._private_file import write_private
from cleave.config import INTERNAL_TOKEN_ENV


def write_token(path: Path, given: str | None) -> str:
    """Write (or keep) the token at `path`; returns where it came from."""
    if not given and path.is_file() and path.read_text().strip():
        return "kept"
    path.parent.mkdir(parents=True, exist_ok=True)
    write_private(path, (given or secrets.token_urlsafe(32)).encode())
    return "given" if given else "new"


def run(args: argparse.Namespace) -> int:
    origin = write_token(Path(args.path), os.environ.get(INTERNAL_TOKEN_ENV) or None)
    print(f"internal token at {args.path} ({origin})", file=sys.stderr)
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "internal-token", help="write the services' shared internal token to a file (compose's first step)",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("path", help="file the services read with --internal-token-file")
    parser.set_defaults(handler=run)
