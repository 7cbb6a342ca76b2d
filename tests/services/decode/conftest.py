"""A tiny checkpoint and a running engine-backed decode worker."""

from __future__ import annotations

import pytest

from tests.worker.cluster import start_decode
from tests.worker.conftest import checkpoint  # noqa: F401  (fixture)


@pytest.fixture
async def decode(checkpoint):  # noqa: F811
    worker = await start_decode(checkpoint, transfer_timeout_s=0.5)
    yield worker
    await worker.close()
