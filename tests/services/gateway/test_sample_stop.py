"""n > 1: a sample that a stop string ends at the gateway stops decoding on its worker at
once (a per-sample Abort), while the request's other samples go on; an Abort reaches only
the connection's own requests."""

from __future__ import annotations

import pytest

from cleave.client import GatewayClient
from cleave.client.gateway import build_request, collect
from cleave.generation.outputs import FinishReason
from cleave.proto.cleave.v1 import common_pb2 as c
from tests.services.gateway.helpers import free_blocks, wait_for_free_blocks

pytestmark = pytest.mark.asyncio(loop_scope="module")
PROMPT = "The quick brown fox"
MAX_TOKENS = 120
INLINE = c.ReasoningOptions(mode=c.REASONING_MODE_INLINE)


class DeltaSpy:
    """Records what a decode worker publishes: per (request, sample), tokens and finish."""

    def __init__(self, backend) -> None:  # type: ignore[no-untyped-def]
        self.tokens: dict[tuple[str, int], int] = {}
        self.finish: dict[tuple[str, int], FinishReason] = {}
        self._backend = backend
        self._publish = backend.streams.publish
        backend.streams.publish = self._record

    def _record(self, gateway_id, deltas, step) -> None:  # type: ignore[no-untyped-def]
        for delta in deltas:
            key = (delta.request_id, delta.sample_index)
            self.tokens[key] = self.tokens.get(key, 0) + len(delta.token_ids)
            if delta.finish_reason is not None:
                self.finish[key] = delta.finish_reason
        self._publish(gateway_id, deltas, step)

    def close(self) -> None:
        self._backend.streams.publish = self._publish


def early_stop(stopping: str, other: str) -> str:
    """A short piece of `stopping`'s early text that `other` never contains."""
    for start in range(1, 12):
        for length in (2, 3, 4):
            piece = stopping[start:start + length]
            if len(piece) == length and piece.strip() and piece not in other:
                return piece
    raise AssertionError(f"no early stop string tells {stopping!r} from {other!r}")


async def test_stop_string_ends_one_sample_on_the_worker(stack):
    sampling = dict(max_tokens=MAX_TOKENS, temperature=1.0, seed=11, n=2, ignore_eos=True, reasoning=INLINE)
    before = free_blocks(stack)
    async with GatewayClient(stack.gateway_address) as client:
        full = await client.complete(PROMPT, **sampling)
        stop = early_stop(full.samples[0].text, full.samples[1].text)
        spy = DeltaSpy(stack.decode[0])
        try:
            cut = await client.complete(PROMPT, stop=[stop], **sampling)
            assert await wait_for_free_blocks(stack, before) == before
        finally:
            spy.close()
    first, second = cut.samples
    assert (first.text, first.finish_reason) == (full.samples[0].text[: full.samples[0].text.index(stop)], "stop")
    assert (second.text, second.finish_reason) == (full.samples[1].text, "length")
    ((request_id, _),) = {key for key in spy.tokens if key[1] == 0}
    # On the worker: sample 0 was aborted a few steps after its stop string, sample 1 ran on.
    assert spy.finish[(request_id, 0)] is FinishReason.ABORT
    assert spy.finish[(request_id, 1)] is FinishReason.LENGTH
    # Disaggregated, the first token reached the gateway with the prefill's answer.
    assert spy.tokens[(request_id, 1)] == MAX_TOKENS - bool(stack.prefill)
    assert spy.tokens[(request_id, 0)] < MAX_TOKENS // 2


async def test_abort_rpc_with_a_sample_index_ends_only_that_sample(stack):
    before = free_blocks(stack)
    async with GatewayClient(stack.gateway_address) as client:
        call = client.stream(build_request(PROMPT, request_id="half", max_tokens=60, n=2, temperature=1.0, seed=5,
                                           ignore_eos=True))
        await anext(aiter(call))
        found = await client.stub.Abort(c.AbortRequest(request_id="half", sample_index=1))
        result = await collect(call)
    assert found.found
    assert [s.finish_reason for s in result.samples] == ["length", "abort"]
    assert result.usage.completion_tokens < 2 * 60
    assert await wait_for_free_blocks(stack, before) == before


async def test_abort_reaches_only_the_connection_that_started_the_request(stack):
    """A request id may be the client's choice, so another client may know it: its Abort,
    over another connection, finds nothing and the request runs on; the starting
    connection's Abort ends it."""
    before = free_blocks(stack)
    async with GatewayClient(stack.gateway_address) as owner, GatewayClient(stack.gateway_address) as other:
        call = owner.stream(build_request(PROMPT, request_id="mine", max_tokens=40, temperature=1.0, seed=5,
                                          ignore_eos=True))
        await anext(aiter(call))
        assert not (await other.stub.Abort(c.AbortRequest(request_id="mine"))).found
        assert not (await other.stub.Abort(c.AbortRequest(request_id="mine", sample_index=0))).found
        result = await collect(call)
        assert [s.finish_reason for s in result.samples] == ["length"] and result.usage.completion_tokens == 40
        again = owner.stream(build_request(PROMPT, request_id="mine", max_tokens=60, temperature=1.0, seed=5,
                                           ignore_eos=True))
        await anext(aiter(again))
        assert (await owner.stub.Abort(c.AbortRequest(request_id="mine"))).found
        assert [s.finish_reason for s in (await collect(again)).samples] == ["abort"]
    assert await wait_for_free_blocks(stack, before) == before
