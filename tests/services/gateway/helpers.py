"""Shared assertions and the in-process reference engine for gateway tests."""

from __future__ import annotations

import asyncio
import functools
from pathlib import Path

from cleave.engine.llm import LLM
from tests.services.gateway.stack import MAX_MODEL_LEN, NUM_BLOCKS, Stack


@functools.lru_cache(maxsize=2)
def reference_llm(model_dir: Path) -> LLM:
    """The offline engine on the same checkpoint and cache shape as the workers."""
    return LLM(model_dir, device="cpu", dtype="float32", max_model_len=MAX_MODEL_LEN, num_blocks=NUM_BLOCKS,
               enforce_eager=True)


def free_blocks(stack: Stack) -> list[int]:
    return [backend.load().num_free_blocks for backend in stack.decode]


async def wait_for_free_blocks(stack: Stack, expected: list[int], timeout_s: float = 5.0) -> list[int]:
    """Poll until every decode worker's free block count is back to `expected`."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while free_blocks(stack) != expected and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.05)
    return free_blocks(stack)


async def assert_decode_pools_full(stack: Stack) -> None:
    """Every decode worker's KV pool is (back to) full and runs nothing."""
    full = [backend.load().num_total_blocks for backend in stack.decode]
    assert await wait_for_free_blocks(stack, full) == full
    assert [backend.load().num_running for backend in stack.decode] == [0] * len(stack.decode)


async def wait_for_no_running(stack: Stack, timeout_s: float = 5.0) -> dict:
    """Poll until the gateway tracks no running request (a handler whose client gave up ends
    a moment after the client saw its stream end); returns what is still running."""
    assert stack.router is not None
    deadline = asyncio.get_running_loop().time() + timeout_s
    while stack.router._running and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.05)
    return dict(stack.router._running)
