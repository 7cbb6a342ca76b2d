"""Abort(sample_index): one sample of an n > 1 request ends, its blocks are freed, and the
other samples go on decoding."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from cleave.proto.cleave.v1 import common_pb2 as c
from cleave.proto.cleave.v1 import decode_pb2 as d
from tests.worker.cluster import GATEWAY, AttachReader, greedy, wait_pool_full

PROMPT = list(range(10, 27))  # 17 tokens: 5 blocks of 4
MAX_TOKENS = 48


async def wait_tokens(reader: AttachReader, request_id: str, sample_index: int, count: int) -> None:
    deadline = time.monotonic() + 10
    while len(reader.tokens(request_id, sample_index)) < count:
        assert time.monotonic() < deadline, "the sample stopped producing tokens"
        await asyncio.sleep(0.005)


async def test_aborting_one_sample_stops_only_that_sample(decode):
    reader = AttachReader(decode.stub)
    total = (await decode.stub.GetLoad(c.GetLoadRequest())).load.num_total_blocks
    await decode.stub.Start(d.StartRequest(
        request_id="two", prefill_locally=True, prompt_token_ids=PROMPT, sampling=greedy(MAX_TOKENS, n=2),
        gateway_id=GATEWAY))
    await wait_tokens(reader, "two", 1, 3)
    response = await decode.stub.Abort(c.AbortRequest(request_id="two", sample_index=1))
    assert response.found
    await reader.wait_finished(["two"], num_samples=1)  # sample 0 runs to its end
    assert reader.finish("two", 1) == c.FINISH_REASON_ABORT
    assert reader.finish("two", 0) == c.FINISH_REASON_LENGTH
    assert len(reader.tokens("two", 0)) == MAX_TOKENS
    stopped_at = len(reader.tokens("two", 1))
    assert 3 <= stopped_at < MAX_TOKENS // 2  # no decode steps for it after the abort
    # Its finish was its last delta: nothing of sample 1 came after it.
    sample_one = [x for x in reader.deltas("two") if x.sample_index == 1]
    assert sample_one[-1].finish_reason == c.FINISH_REASON_ABORT
    assert not (await decode.stub.Abort(c.AbortRequest(request_id="two", sample_index=1))).found
    load = await wait_pool_full(decode.stub)
    assert load.num_free_blocks == total
    await reader.cancel()


async def test_sample_abort_of_unknown_samples_and_bad_indexes(decode):
    reader = AttachReader(decode.stub)
    await decode.stub.Start(d.StartRequest(
        request_id="one", prefill_locally=True, prompt_token_ids=PROMPT, sampling=greedy(200, n=2),
        gateway_id=GATEWAY))
    assert not (await decode.stub.Abort(c.AbortRequest(request_id="one", sample_index=2))).found
    assert not (await decode.stub.Abort(c.AbortRequest(request_id="nobody", sample_index=0))).found
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await decode.stub.Abort(c.AbortRequest(request_id="one", sample_index=-1))
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "sample_index" in raised.value.details()
    # Both samples one by one: the request ends, every block comes back.
    assert (await decode.stub.Abort(c.AbortRequest(request_id="one", sample_index=0))).found
    assert (await decode.stub.Abort(c.AbortRequest(request_id="one", sample_index=1))).found
    await reader.wait_finished(["one"], num_samples=2)
    assert [reader.finish("one", i) for i in (0, 1)] == [c.FINISH_REASON_ABORT] * 2
    assert not (await decode.stub.Abort(c.AbortRequest(request_id="one"))).found
    await wait_pool_full(decode.stub)
    await reader.cancel()
