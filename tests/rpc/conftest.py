"""TLS files for the rpc tests: a stack's, and another stack's."""

from __future__ import annotations

import pytest

from cleave.tls import TlsConfig
from tests.tls_files import stack_tls


@pytest.fixture
def tls(tmp_path) -> TlsConfig:
    return stack_tls(tmp_path / "stack")


@pytest.fixture
def stranger(tmp_path) -> TlsConfig:
    """A certificate of another stack: another CA signed it (in test_tls_reload, the files a
    rotation brings)."""
    return stack_tls(tmp_path / "stranger")
