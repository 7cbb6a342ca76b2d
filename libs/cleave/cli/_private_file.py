"""Secrets on disk: written whole (readers never see a partial file) and readable by their
owner only."""

from __future__ import annotations

import os
from pathlib import Path


def write_private(path: Path, data: bytes) -> None:
    """Write `data` to `path` with mode 0600, through a staged file renamed into place."""
    staged = path.with_name(path.name + ".tmp")
    descriptor = os.open(staged, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(descriptor, "wb") as out:
        out.write(data)
    os.replace(staged, path)
