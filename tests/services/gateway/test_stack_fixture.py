"""The in-process test stack stops what it started when its own start fails part-way, so a
fixture whose setup fails leaves no server listening."""

from __future__ import annotations

import asyncio

import pytest

from tests.services.gateway import stack as stack_module


async def test_a_start_that_fails_at_the_http_api_closes_every_server_it_started(model_dir, monkeypatch):
    closed: list[stack_module.Stack] = []
    close = stack_module.Stack.close

    async def recording_close(self):  # type: ignore[no-untyped-def]
        closed.append(self)
        await close(self)

    async def failing_start_http(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise RuntimeError("no port for the HTTP API")

    monkeypatch.setattr(stack_module.Stack, "close", recording_close)
    monkeypatch.setattr(stack_module, "start_http", failing_start_http)
    with pytest.raises(RuntimeError, match="no port for the HTTP API"):
        await stack_module.start_stack(model_dir, "disaggregated")
    (stack,) = closed
    assert stack.gateway_address and stack.kvstore_address  # it got that far
    for address in (stack.gateway_address, stack.kvstore_address):
        host, port = address.rsplit(":", 1)
        with pytest.raises(OSError):  # nothing listens there any more
            _, writer = await asyncio.open_connection(host, int(port))
            writer.close()
