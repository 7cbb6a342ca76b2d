"""A disaggregated start's Prefill call ends with its request, however early the request
ends: one whose deadline passes between its first tokens and its stream's first read (a busy
event loop resumes the request late) ends before the handoff task that reads the rest of the
call ever ran. That call is cancelled all the same: the prefill worker sees the
cancellation, and every pool ends full. Before, the call stayed open, unread, for the
gateway's lifetime (bench/soak.py: about 10 calls in 400 mixed requests)."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from cleave.client import GatewayClient
from cleave.errors import DeadlineExceeded
from services.gateway import request_stream
from tests.services.gateway.helpers import assert_decode_pools_full, wait_for_no_running
from tests.services.gateway.stack import start_stack
from tests.services.gateway.test_hung_worker import Hang

PROMPT = "A request whose deadline passes as its first tokens arrive"
CLIENT_TIMEOUT_S = 60.0
GUARD_S = 20.0  # a guard, not a wait: the cancellation reaches the prefill worker at once


async def test_a_request_that_ends_before_its_handoff_ran_cancels_its_prefill_call(model_dir, monkeypatch):
    stack = await start_stack(model_dir, "disaggregated")
    # the KV stays on the prefill worker: its Prefill stream stays open after the first tokens
    held = Hang(stack.prefill[0], "_send")

    def passed(deadline: float | None) -> float | None:
        raise DeadlineExceeded("the request's deadline passed; allow more time or ask for fewer tokens")

    # the deadline passes between the first tokens and the stream's first read, as when the
    # request resumes late on a busy loop
    monkeypatch.setattr(request_stream, "time_left", passed)
    try:
        async with GatewayClient(stack.gateway_address) as client:
            with pytest.raises(grpc.aio.AioRpcError) as raised:
                await client.complete(PROMPT, max_tokens=8, temperature=0.0, ignore_eos=True,
                                      timeout=CLIENT_TIMEOUT_S)
        assert raised.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED, raised.value
        assert held.entered.is_set()  # the first tokens had gone out; the KV had not
        await asyncio.wait_for(held.cancelled.wait(), GUARD_S)  # the gateway cancelled the Prefill call
        held.release()
        assert await wait_for_no_running(stack) == {}
        await assert_decode_pools_full(stack)
        load = stack.prefill[0].load()
        assert (load.num_running, load.num_free_blocks) == (0, load.num_total_blocks)
    finally:
        held.release()
        await stack.close()
