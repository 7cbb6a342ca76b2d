"""Import a bench script (`bench/<name>.py`) in a test, as module `bench_<name>`."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType

BENCH = Path(__file__).resolve().parents[2] / "bench"


@contextmanager
def imported_bench(name: str) -> Iterator[ModuleType]:
    """bench/<name>.py, registered in sys.modules while in use (its dataclasses look their
    module up while being built) and removed after."""
    module_name = f"bench_{name}"
    spec = importlib.util.spec_from_file_location(module_name, BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)  # type: ignore[union-attr]
        yield module
    finally:
        sys.modules.pop(module_name, None)
