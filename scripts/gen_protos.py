#!/usr/bin/env python3
"""Regenerate the committed Python stubs of protos/cleave/v1 into libs/cleave/proto.

    python scripts/gen_protos.py           # rewrite the stubs
    python scripts/gen_protos.py --check   # exit 1, listing stale files, when they drift

protoc writes `cleave/v1/x_pb2.py` with `from cleave.v1 import common_pb2`; the stubs live
under the `cleave.proto` package (`from cleave.proto.cleave.v1 import gateway_pb2`), so those
imports are rewritten to `from cleave.proto.cleave.v1 import ...`. The generated grpc version
guard is lowered to GRPC_MIN_VERSION (the floor in pyproject.toml): the stubs only use APIs
that exist since then, and GPU images ship older grpcio than the generator here.
"""

from __future__ import annotations

import argparse
import filecmp
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = REPO_ROOT / "protos"
PROTO_PACKAGE_DIR = Path("cleave") / "v1"
OUTPUT_ROOT = REPO_ROOT / "libs" / "cleave" / "proto"
GRPC_MIN_VERSION = "1.66.0"

_IMPORT_RE = re.compile(r"^from cleave\.v1 import ", re.MULTILINE)
_GRPC_VERSION_RE = re.compile(r"^GRPC_GENERATED_VERSION = '[^']*'$", re.MULTILINE)
_INIT_DOCSTRINGS = {
    Path("cleave") / "__init__.py": '"""Generated stubs of the cleave protos (protos/cleave)."""\n',
    PROTO_PACKAGE_DIR / "__init__.py": '"""Generated stubs of package cleave.v1 (protos/cleave/v1)."""\n',
}


def generate(proto_root: Path, output_root: Path) -> list[Path]:
    """Run protoc on every .proto under proto_root/cleave/v1; return the written paths."""
    import grpc_tools
    from grpc_tools import protoc

    protos = sorted((proto_root / PROTO_PACKAGE_DIR).glob("*.proto"))
    if not protos:
        raise SystemExit(f"no .proto files under {proto_root / PROTO_PACKAGE_DIR}")
    well_known = Path(grpc_tools.__file__).parent / "_proto"
    args = [
        "grpc_tools.protoc",
        f"-I{proto_root}",
        f"-I{well_known}",
        f"--python_out={output_root}",
        f"--pyi_out={output_root}",
        f"--grpc_python_out={output_root}",
        *(str(path.relative_to(proto_root)) for path in protos),
    ]
    cwd = os.getcwd()
    os.chdir(proto_root)  # protoc records paths relative to the include root
    try:
        if protoc.main(args) != 0:
            raise SystemExit("protoc failed (see the messages above)")
    finally:
        os.chdir(cwd)
    written = []
    for path in sorted((output_root / PROTO_PACKAGE_DIR).iterdir()):
        if path.suffix not in (".py", ".pyi") or path.name == "__init__.py":
            continue
        text = _IMPORT_RE.sub("from cleave.proto.cleave.v1 import ", path.read_text())
        text = _GRPC_VERSION_RE.sub(f"GRPC_GENERATED_VERSION = '{GRPC_MIN_VERSION}'", text)
        path.write_text(text)
        written.append(path)
    for relative, docstring in _INIT_DOCSTRINGS.items():
        (output_root / relative).write_text(docstring)
        written.append(output_root / relative)
    return written


def stale_files(proto_root: Path, output_root: Path) -> list[str]:
    """Paths (relative to output_root) whose committed content differs from a fresh build."""
    with tempfile.TemporaryDirectory() as tmp:
        fresh_root = Path(tmp)
        fresh = {p.relative_to(fresh_root) for p in generate(proto_root, fresh_root)}
        committed = {
            p.relative_to(output_root)
            for p in (output_root / PROTO_PACKAGE_DIR).glob("*.py*")
            if p.suffix in (".py", ".pyi")
        } | {rel for rel in _INIT_DOCSTRINGS if (output_root / rel).exists()}
        stale = []
        for relative in sorted(fresh | committed):
            old, new = output_root / relative, fresh_root / relative
            if not old.exists() or not new.exists() or not filecmp.cmp(old, new, shallow=False):
                stale.append(str(relative))
        return stale


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if the stubs are stale")
    parser.add_argument("--proto-root", type=Path, default=PROTO_ROOT)
    parser.add_argument("--output-root", type=Path, default=OUTPUT_ROOT)
    args = parser.parse_args(argv)
    if args.check:
        stale = stale_files(args.proto_root, args.output_root)
        if stale:
            print("generated stubs are stale; run `python scripts/gen_protos.py`:", file=sys.stderr)
            for relative in stale:
                print(f"  {args.output_root / relative}", file=sys.stderr)
            return 1
        print("generated stubs are up to date")
        return 0
    target = args.output_root / PROTO_PACKAGE_DIR
    if target.exists():
        shutil.rmtree(target)
    target.mkdir(parents=True)
    for path in generate(args.proto_root, args.output_root):
        print(f"wrote {path.relative_to(REPO_ROOT) if path.is_relative_to(REPO_ROOT) else path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
