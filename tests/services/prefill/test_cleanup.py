"""`run_to_end`: a cleanup runs to its end however often its caller is cancelled meanwhile."""

from __future__ import annotations

import asyncio

import pytest

from services.prefill.cleanup import run_to_end


async def test_returns_the_cleanup_result_and_raises_its_error():
    async def value() -> int:
        await asyncio.sleep(0)
        return 7

    async def broken() -> None:
        await asyncio.sleep(0)
        raise OSError("broken")

    assert await run_to_end(value()) == 7
    with pytest.raises(OSError, match="broken"):
        await run_to_end(broken())


async def test_a_caller_cancelled_again_and_again_waits_for_the_whole_cleanup():
    steps: list[str] = []
    go_on = asyncio.Event()

    async def cleanup() -> None:
        steps.append("first")
        await go_on.wait()
        steps.append("second")  # what a cut-short await would skip

    async def caller() -> None:
        try:
            await run_to_end(cleanup())
        finally:
            steps.append("after")

    task = asyncio.ensure_future(caller())
    while not steps:
        await asyncio.sleep(0)
    for _ in range(3):
        task.cancel()
        await asyncio.sleep(0)
    assert steps == ["first"] and not task.done()
    go_on.set()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert steps == ["first", "second", "after"]
