"""The first token reaches the client before the prompt's KV reaches the decode worker, and a
KV handoff that fails after it moves the request instead of failing it: the client's stream
equals an undisturbed greedy run (no token twice) and every pool ends full."""

from __future__ import annotations

import asyncio

import structlog

from cleave.client import GatewayClient
from cleave.errors import Unavailable
from cleave.generation.sampling_params import SamplingParams
from cleave.proto.cleave.v1 import gateway_pb2 as g
from tests.services.gateway.helpers import reference_llm, wait_for_free_blocks
from tests.services.gateway.stack import Stack, start_stack

PROMPT = "The first token of a disaggregated request"
MAX_TOKENS = 12
IDS = g.StreamOptions(include_token_ids=True)


def _expected(model_dir) -> list[int]:  # type: ignore[no-untyped-def]
    (output,) = reference_llm(model_dir).generate(
        [PROMPT], SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True))
    return output.outputs[0].token_ids


async def _pools_full(stack: Stack) -> None:
    full = [backend.load().num_total_blocks for backend in stack.decode]
    assert await wait_for_free_blocks(stack, full) == full
    prefill = stack.prefill[0].load()
    assert (prefill.num_running, prefill.num_free_blocks) == (0, prefill.num_total_blocks)


async def test_the_first_token_streams_while_the_kv_is_still_held_back(model_dir):
    stack = await start_stack(model_dir, "disaggregated")
    backend = stack.prefill[0]
    release = asyncio.Event()
    send = backend._send

    async def held_send(*args, **kwargs):  # type: ignore[no-untyped-def]
        await release.wait()
        return await send(*args, **kwargs)

    backend._send = held_send
    try:
        expected = _expected(model_dir)
        async with GatewayClient(stack.gateway_address) as client:
            stream = client.generate(PROMPT, max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, stream=IDS)
            tokens: list[int] = []
            async for response in stream:
                tokens.extend(t for sample in response.samples for t in sample.token_ids)
                if tokens:
                    break
            assert tokens == expected[:1] and not release.is_set()  # the KV had not gone out
            release.set()
            async for response in stream:
                tokens.extend(t for sample in response.samples for t in sample.token_ids)
        assert tokens == expected
        await _pools_full(stack)
    finally:
        release.set()
        await stack.close()


async def test_a_handoff_that_fails_after_the_first_token_moves_the_request(model_dir):
    stack = await start_stack(model_dir, "disaggregated")
    backend = stack.prefill[0]

    async def broken_send(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise Unavailable("the KV transfer broke mid-transfer", field="decode")

    backend._send = broken_send
    try:
        with structlog.testing.capture_logs() as logs:
            async with GatewayClient(stack.gateway_address) as client:
                result = await client.complete(PROMPT, max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True,
                                               stream=IDS)
        assert result.samples[0].token_ids == _expected(model_dir)
        assert result.samples[0].finish_reason == "length"
        moved = [entry for entry in logs if entry["event"] == "request migrated"]
        assert len(moved) == 1 and moved[0]["num_generated"] == 1
        # whichever the gateway heard first: the Prefill stream's error, or the decode
        # worker's ABORT of the reservation the prefill worker gave up
        assert "failed after the first tokens" in moved[0]["reason"] or "while its KV was on the way" in moved[0]["reason"]
        await _pools_full(stack)
    finally:
        await stack.close()


async def test_an_abort_before_the_handoff_delivered_moves_the_request():
    """The decode worker's ABORT of a worker request counts as a loss while its handoff is
    pending or failed (in either order with the handoff's own error), not once delivered."""
    from cleave.proto.cleave.v1 import common_pb2 as c, decode_pb2 as d
    from services.gateway.delta_queue import DeltaQueue
    from services.gateway.placement import RunningRequest, WorkerRequest
    from services.gateway.workers import WorkerHandle

    decode = WorkerHandle("decode", "d:1", None, None, None, healthy=True)  # type: ignore[arg-type]
    part = WorkerRequest("w-1", decode, None, (0,))  # type: ignore[arg-type]
    running = RunningRequest(DeltaQueue())
    running.add(part)
    abort = d.RequestDelta(request_id="w-1", finish_reason=c.FINISH_REASON_ABORT)
    finished = d.RequestDelta(request_id="w-1", finish_reason=c.FINISH_REASON_LENGTH)
    assert running.lost_in_handoff(abort) is None  # no handoff: a colocated start
    loop = asyncio.get_running_loop()
    for outcome in (None, False):  # pending, failed
        part.handoff = loop.create_future()
        if outcome is not None:
            part.handoff.set_result(outcome)
        lost = running.lost_in_handoff(abort)
        assert lost is not None and lost.worker_request_id == "w-1"
        assert running.lost_in_handoff(finished) is None
    part.handoff = loop.create_future()
    part.handoff.set_result(True)  # delivered: an ABORT now is the request's own end
    assert running.lost_in_handoff(abort) is None
