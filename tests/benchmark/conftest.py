"""Fixtures: the scripted OpenAI server on a free port."""

from __future__ import annotations

import ssl

import pytest
from aiohttp import web

from tests.benchmark.fake_openai import FakeOpenAI


@pytest.fixture
async def fake_server():
    """Starts a FakeOpenAI per call of the returned factory (https with `ssl_context`); every one
    stops at teardown."""
    runners = []

    async def start(ssl_context: ssl.SSLContext | None = None, **kwargs) -> tuple[FakeOpenAI, str]:
        fake = FakeOpenAI(**kwargs)
        runner = web.AppRunner(fake.app())
        await runner.setup()
        runners.append(runner)
        site = web.TCPSite(runner, "127.0.0.1", 0, ssl_context=ssl_context)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        return fake, f"{'http' if ssl_context is None else 'https'}://127.0.0.1:{port}"

    yield start
    for runner in runners:
        await runner.cleanup()
