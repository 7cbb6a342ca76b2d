"""Import a bench script (`bench/<name>.py`) in a test, as module `bench_<name>`."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


@contextmanager
def imported_bench(name: str) -> Iterator[ModuleType]:
    """bench/<name>.py, registered in sys.modules while in use (its dataclasses look their
    module up while being built). After it, sys.path and the modules are as before: a bench
    script may put bench/ on the path and imports bench/'s `common` by that bare name, which
    later tests must not find."""
    module_name = f"bench_{name}"
    saved_path, saved_modules = list(sys.path), set(sys.modules)
    spec = importlib.util.spec_from_file_location(module_name, BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)  # type: ignore[union-attr]
        yield module
    finally:
        sys.path[:] = saved_path
        for added in set(sys.modules) - saved_modules:
            if added == module_name or _from_bench(sys.modules[added]):
                del sys.modules[added]


def bench_fixture(name: str):  # type: ignore[no-untyped-def]
    """A module-scoped pytest fixture holding bench/<name>.py (`imported_bench`); assign it to
    the fixture's name in the test module: `bench = bench_fixture("moe")`."""

    @pytest.fixture(scope="module")
    def fixture() -> Iterator[ModuleType]:
        with imported_bench(name) as module:
            yield module

    return fixture


def _from_bench(module: ModuleType) -> bool:
    origin = getattr(module, "__file__", None)
    return origin is not None and Path(origin).resolve().parent == BENCH
