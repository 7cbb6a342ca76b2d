"""A prefill cancelled again while it is already cleaning up after an error or a first
cancellation (a gRPC handler can be cancelled more than once, and a client can give up on a
call that is already failing) still frees the prompt's exported KV blocks."""

from __future__ import annotations

import asyncio
import time

import pytest

from cleave.generation.sampling_params import SamplingParams
from cleave.rpc.types import TransferHandle, TransportKind
from services.prefill.backend import PrefillSpec
from tests.worker.cluster import wait_pool_full

PROMPT = tuple(range(30, 49))  # 19 tokens: 5 blocks of 4


async def test_a_prefill_cancelled_on_every_await_still_frees_its_exported_blocks(prefill):
    # A receiver that accepts the KV but never confirms: the prefill waits in the send,
    # holding the prompt's exported blocks.
    silent = await asyncio.start_server(lambda reader, writer: reader.read(-1), "127.0.0.1", 0)
    try:
        port = silent.sockets[0].getsockname()[1]
        handle = TransferHandle(transport=TransportKind.TCP, address=f"127.0.0.1:{port}", transfer_id="t",
                                block_ids=(1, 2, 3, 4, 5))
        backend = prefill.backend
        full = backend.load().num_total_blocks
        spec = PrefillSpec(request_id="again", prompt_token_ids=PROMPT,
                           sampling=SamplingParams(max_tokens=4, temperature=0.0), destination=handle)
        task = asyncio.ensure_future(backend.prefill(spec))
        deadline = time.monotonic() + 5
        while backend.load().num_free_blocks == full:
            assert time.monotonic() < deadline and not task.done(), "the prompt's KV was never held for the send"
            await asyncio.sleep(0.01)
        # Cancel on every pass of the event loop until the prefill ends: each await on its
        # error path (closing the sender, withdrawing the layer stream, the release) meets
        # a fresh cancellation.
        num_cancels = 0
        while not task.done():
            task.cancel()
            num_cancels += 1
            await asyncio.sleep(0)
        assert num_cancels > 1  # the error path was cancelled again
        with pytest.raises(asyncio.CancelledError):
            await task
        assert backend.load().num_running == 0
        await wait_pool_full(prefill.stub)
    finally:
        silent.close()
