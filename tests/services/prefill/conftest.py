"""A tiny checkpoint and a running engine-backed prefill worker."""

from __future__ import annotations

import pytest

from tests.worker.cluster import start_prefill
from tests.worker.conftest import checkpoint  # noqa: F401  (fixture)


@pytest.fixture
async def prefill(checkpoint):  # noqa: F811
    worker = await start_prefill(checkpoint)
    yield worker
    await worker.close()
