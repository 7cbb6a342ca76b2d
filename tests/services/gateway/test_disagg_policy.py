"""Conditional disaggregation: the per-request choice, and a conditional stack that serves
short prompts on the decode worker and long ones through the prefill worker, token for token
as the in-process engine does."""

from __future__ import annotations

import asyncio

import pytest

from cleave.client import GatewayClient
from cleave.generation.sampling_params import SamplingParams
from cleave.proto.cleave.v1 import gateway_pb2 as g
from cleave.rpc.types import WorkerLoad
from services.gateway.disagg_policy import ConditionalPrefill, DisaggregationPolicy
from services.gateway.workers import WorkerHandle
from tests.services.gateway.helpers import free_blocks, reference_llm, wait_for_free_blocks
from tests.services.gateway.stack import start_stack

IDS = g.StreamOptions(include_token_ids=True)
POLICY = DisaggregationPolicy(local_max_tokens=32, remote_max_queue_tokens=1000)


def worker(role: str, address: str, queued: int = 0, running: int = 0, waiting: int = 0) -> WorkerHandle:
    handle = WorkerHandle(role, address, None, None, None, healthy=True)  # type: ignore[arg-type]
    handle.load = WorkerLoad(worker_id=address, num_queued_prompt_tokens=queued, num_running=running,
                             num_waiting=waiting)
    return handle


def test_short_prompts_prefill_on_the_decode_worker_and_long_ones_remotely():
    choice = ConditionalPrefill(POLICY)
    decode, prefill = worker("decode", "d:1"), worker("prefill", "p:1")
    assert not choice.remote(decode, [prefill], list(range(32)))
    assert choice.remote(decode, [prefill], list(range(33)))
    assert not choice.remote(decode, [], list(range(500)))  # no prefill worker in rotation


def test_a_prefix_the_decode_worker_caches_counts_as_computed():
    choice = ConditionalPrefill(POLICY)
    decode, other, prefill = worker("decode", "d:1"), worker("decode", "d:2"), worker("prefill", "p:1")
    system = list(range(100, 164))  # four full blocks
    choice.record(decode, system + [1, 2])
    assert choice.cached_on(decode, system + [7] * 20) == 64
    assert not choice.remote(decode, [prefill], system + [7] * 20)  # 20 uncached tokens
    assert choice.remote(other, [prefill], system + [7] * 20)  # the other worker holds none of it
    assert choice.remote(decode, [prefill], system + [7] * 40)


def test_a_long_prefill_queue_keeps_long_prompts_local():
    choice = ConditionalPrefill(POLICY)
    decode = worker("decode", "d:1")
    busy, idle = worker("prefill", "p:1", queued=5000), worker("prefill", "p:2", queued=999)
    assert choice.remote(decode, [busy, idle], list(range(200)))
    assert not choice.remote(decode, [busy], list(range(200)))


def test_a_busy_decode_worker_sends_short_prompts_to_a_prefill_worker_with_room():
    choice = ConditionalPrefill(DisaggregationPolicy(local_max_tokens=32, remote_max_queue_tokens=1000,
                                                     local_max_running=8, remote_busy_max_queue_tokens=500))
    prefill = worker("prefill", "p:1", queued=500)
    assert not choice.remote(worker("decode", "d:1", running=8), [prefill], list(range(5)))
    assert choice.remote(worker("decode", "d:1", running=9), [prefill], list(range(5)))
    assert choice.remote(worker("decode", "d:1", running=6, waiting=3), [prefill], list(range(5)))
    live = worker("decode", "d:1", running=0)
    live.in_flight = 9  # this gateway's own requests there, fresher than the last report
    assert choice.remote(live, [prefill], list(range(5)))
    # a short prompt waits for no long one there: past its own bound, local however busy the decode worker
    assert not choice.remote(worker("decode", "d:1", running=50), [worker("prefill", "p:2", queued=501)],
                             list(range(5)))
    assert choice.remote(worker("decode", "d:1", running=50), [worker("prefill", "p:2", queued=501)],
                         list(range(33)))  # a long prompt goes while the queue is within its own bound
    assert not choice.remote(worker("decode", "d:1", running=50), [], list(range(5)))


def test_an_idle_prefill_worker_takes_short_prompts_too():
    choice = ConditionalPrefill(DisaggregationPolicy(local_max_tokens=32, remote_max_queue_tokens=1000,
                                                     remote_idle_tokens=64))
    decode = worker("decode", "d:1")
    idle, busier = worker("prefill", "p:1", queued=64), worker("prefill", "p:2", queued=65)
    assert choice.remote(decode, [idle], list(range(5)))  # short, but the prefill worker has room
    assert not choice.remote(decode, [busier], list(range(5)))  # past the idle bound: local as before
    assert choice.remote(decode, [busier], list(range(33)))  # long prompts: the queue bound still rules
    assert not choice.remote(decode, [], list(range(5)))
    assert not ConditionalPrefill(POLICY).remote(decode, [worker("prefill", "p:3")], list(range(5)))  # off by default


def test_thresholds_must_not_be_negative():
    with pytest.raises(ValueError, match="thresholds"):
        DisaggregationPolicy(local_max_tokens=-1)
    with pytest.raises(ValueError, match="thresholds"):
        DisaggregationPolicy(remote_idle_tokens=-1)
    with pytest.raises(ValueError, match="thresholds"):
        DisaggregationPolicy(local_max_running=-1)
    with pytest.raises(ValueError, match="thresholds"):
        DisaggregationPolicy(remote_busy_max_queue_tokens=-1)


async def test_conditional_stack_serves_both_paths_token_for_token(model_dir):
    short, long = "Hi there", "The quick brown fox jumps over the lazy dog " * 6
    expected = reference_llm(model_dir).generate([short, long], SamplingParams(max_tokens=8, temperature=0.0))
    stack = await start_stack(model_dir, "conditional", policy=POLICY)
    try:
        before = free_blocks(stack)
        async with GatewayClient(stack.gateway_address) as client:
            results = await asyncio.gather(
                *(client.complete(p, max_tokens=8, temperature=0.0, stream=IDS) for p in (short, long)))
        for result, reference in zip(results, expected):
            assert result.samples[0].token_ids == reference.outputs[0].token_ids
        assert len(expected[0].prompt_token_ids) <= POLICY.local_max_tokens < len(expected[1].prompt_token_ids)
        (prefill,) = stack.prefill
        assert prefill.counters.num_prefills == 1  # the long prompt alone
        assert prefill.counters.num_prompt_tokens == len(expected[1].prompt_token_ids)
        assert await wait_for_free_blocks(stack, before) == before
    finally:
        await stack.close()


def test_choose_takes_the_callers_hashes_and_hashes_nothing_itself(monkeypatch):
    from services.gateway.routing import PrefixAffinity

    prompt = list(range(100, 164))
    hashes = PrefixAffinity().hashes(prompt)  # the router's affinity hashes, the same chain
    choice = ConditionalPrefill(POLICY)

    def refuse(token_ids):  # type: ignore[no-untyped-def]
        raise AssertionError("hashed again")

    monkeypatch.setattr(choice.decode_prefixes, "hashes", refuse)
    decode = worker("decode", "d:1")
    assert choice.choose(decode, [worker("prefill", "p:1")], prompt, hashes)  # 64 uncached tokens: remote
    assert choice.cached_on(decode, prompt, hashes) == 64  # recorded under those hashes
