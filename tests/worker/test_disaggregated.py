"""A request driven as the gateway drives it: Admit -> Prefill -> Start -> Attach, and the
colocated baseline; greedy tokens equal the in-process LLM's, KV pools end full."""

from __future__ import annotations

import asyncio
import random

import pytest

from cleave.engine.llm import LLM
from cleave.generation.sampling_params import SamplingParams
from cleave.proto.cleave.v1 import common_pb2 as c
from cleave.proto.cleave.v1 import decode_pb2 as d
from cleave.proto.cleave.v1 import prefill_pb2 as p
from cleave.rpc.prefill_call import prefill_response
from tests.worker.cluster import (
    ENGINE_ARGS,
    GATEWAY,
    AttachReader,
    greedy,
    start_decode,
    start_kvstore,
    start_prefill,
    wait_pool_full,
)

MAX_TOKENS = 12


def prompts(count: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(5, 500) for _ in range(rng.randint(9, 30))] for _ in range(count)]


@pytest.fixture(scope="module")
def reference(checkpoint):
    """The in-process LLM's greedy continuations of the test prompts."""
    llm = LLM(checkpoint, **ENGINE_ARGS)
    outputs = llm.generate(prompts(3), SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True))
    return [output.outputs[0].token_ids for output in outputs]


async def disaggregated(decode, prefill, request_id: str, prompt: list[int], store: bool = False) -> p.PrefillResponse:
    """What a gateway does for one request before its tokens stream on Attach."""
    admitted = await decode.stub.Admit(d.AdmitRequest(
        request_id=request_id, prompt_token_ids=prompt, sampling=greedy(MAX_TOKENS), gateway_id=GATEWAY,
        prefill_worker_id="prefill-0"))
    handle = admitted.handle
    assert handle.transport == c.TRANSPORT_KIND_TCP and len(handle.block_ids) == -(-len(prompt) // 4)
    prefilled = await prefill_response(prefill.stub.Prefill(p.PrefillRequest(
        request_id=request_id, prompt_token_ids=prompt, sampling=greedy(MAX_TOKENS), destination=handle,
        store_to_kvstore=store)))
    await decode.stub.Start(d.StartRequest(request_id=request_id, first_token_ids=prefilled.first_token_ids,
                                           gateway_id=GATEWAY))
    return prefilled


async def test_disaggregated_requests_match_llm_and_batch_per_step(checkpoint, reference):
    decode, prefill = await start_decode(checkpoint), await start_prefill(checkpoint)
    try:
        reader = AttachReader(decode.stub)
        ids = [f"r{i}" for i in range(3)]
        results = await asyncio.gather(*(disaggregated(decode, prefill, rid, prompt)
                                         for rid, prompt in zip(ids, prompts(3))))
        await reader.wait_finished(ids)
        for rid, prompt, result, expected in zip(ids, prompts(3), results, reference):
            assert result.first_token_ids[0] == expected[0]
            assert (result.num_prompt_tokens, result.num_cached_tokens, result.num_computed_tokens) == (
                len(prompt), 0, len(prompt))
            assert result.transfer.num_blocks == -(-len(prompt) // 4) and result.transfer.num_bytes > 0
            assert reader.tokens(rid) == expected  # the first token streams first, like every later one
            assert reader.finish(rid) == c.FINISH_REASON_LENGTH
        # One message per step for all of the gateway's requests, never one per token.
        total_tokens = sum(len(reader.tokens(rid)) for rid in ids)
        assert len(reader.messages) < total_tokens
        assert max(len({x.request_id for x in m.deltas}) for m in reader.messages) > 1
        assert [m.step for m in reader.messages] == sorted({m.step for m in reader.messages})
        await wait_pool_full(decode.stub)
        await wait_pool_full(prefill.stub)
        await reader.cancel()
    finally:
        await decode.close()
        await prefill.close()


async def test_a_stream_interval_sends_several_tokens_per_delta_and_the_same_tokens(checkpoint, reference):
    decode, prefill = await start_decode(checkpoint, stream_interval=3), await start_prefill(checkpoint)
    try:
        reader = AttachReader(decode.stub)
        ids = [f"r{i}" for i in range(3)]
        await asyncio.gather(*(disaggregated(decode, prefill, rid, prompt) for rid, prompt in zip(ids, prompts(3))))
        await reader.wait_finished(ids)
        for rid, expected in zip(ids, reference):
            assert reader.tokens(rid) == expected
            assert reader.finish(rid) == c.FINISH_REASON_LENGTH
            # after the first delta, tokens come three steps' worth at a time (the end at once)
            sizes = [len(delta.token_ids) for delta in reader.deltas(rid)]
            assert max(sizes) == 3 and len(sizes) < MAX_TOKENS // 2
        await wait_pool_full(decode.stub)
        await reader.cancel()
    finally:
        await decode.close()
        await prefill.close()


async def test_colocated_matches_llm_with_n_samples(checkpoint, reference):
    decode = await start_decode(checkpoint)
    try:
        reader = AttachReader(decode.stub)
        for index, prompt in enumerate(prompts(3)):
            response = await decode.stub.Start(d.StartRequest(
                request_id=f"co{index}", prefill_locally=True, prompt_token_ids=prompt,
                sampling=greedy(MAX_TOKENS, n=2 if index == 0 else 1), gateway_id=GATEWAY))
            assert response.num_cached_tokens == 0
        await reader.wait_finished([f"co{i}" for i in range(3)])
        await reader.wait_finished(["co0"], num_samples=2)
        for index, expected in enumerate(reference):
            assert reader.tokens(f"co{index}") == expected
        assert reader.tokens("co0", 1) == reference[0]  # greedy samples agree
        # The same prompt again hits the worker's prefix cache.
        again = await decode.stub.Start(d.StartRequest(
            request_id="co-again", prefill_locally=True, prompt_token_ids=prompts(3)[1],
            sampling=greedy(MAX_TOKENS), gateway_id=GATEWAY))
        assert again.num_cached_tokens == (len(prompts(3)[1]) - 1) // 4 * 4
        await reader.wait_finished(["co-again"])
        assert reader.tokens("co-again") == reference[1]
        await wait_pool_full(decode.stub)
        await reader.cancel()
    finally:
        await decode.close()


async def test_kvstore_prefix_is_reused_not_recomputed(checkpoint, reference):
    store = await start_kvstore()
    address = store.server.address
    first, decode = await start_prefill(checkpoint, kvstore=address), await start_decode(checkpoint)
    second = await start_prefill(checkpoint, kvstore=address)  # a cold worker: only the store has the KV
    try:
        reader = AttachReader(decode.stub)
        prompt = prompts(3)[2]
        cold = await disaggregated(decode, first, "kv-a", prompt, store=True)
        assert cold.num_cached_tokens == 0
        assert await first.backend.wait_for_stores(timeout_s=5.0)  # the put runs after the response
        assert first.backend.counters.num_kvstore_blocks_stored == 0  # a prefix seen once is not stored
        await disaggregated(decode, first, "kv-a2", prompt, store=True)  # the prefix repeats: stored
        assert await first.backend.wait_for_stores(timeout_s=5.0)
        assert first.backend.counters.num_kvstore_blocks_stored == len(prompt) // 4
        stored, index = second.backend.kvstore.hashes(prompt), second.backend.kvstore.client.index
        await index.wait_until(lambda i: not i.is_live or i.num_leading(stored) == len(stored), 30)  # heard over Watch
        warm = await disaggregated(decode, second, "kv-b", prompt)
        reused = (len(prompt) - 1) // 4 * 4
        assert (warm.num_cached_tokens, warm.num_computed_tokens) == (reused, len(prompt) - reused)
        assert second.backend.counters.num_computed_tokens == len(prompt) - reused
        assert second.backend.counters.num_kvstore_blocks_loaded == reused // 4
        await reader.wait_finished(["kv-a", "kv-a2", "kv-b"])
        # KV fetched from the store, then shipped to decode, gives the same tokens.
        assert reader.tokens("kv-a") == reader.tokens("kv-a2") == reader.tokens("kv-b") == reference[2]
        for worker in (first, second, decode):
            await wait_pool_full(worker.stub)
        await reader.cancel()
    finally:
        for worker in (first, second, decode, store):
            await worker.close()


async def test_disaggregated_seeded_samples_equal_colocated_llm(checkpoint):
    """n = 4 seeded samples: one prefill and one prompt transfer; the samples equal the
    in-process LLM's (first tokens from the prefill worker, the rest from the decode worker)."""
    prompt = prompts(1, seed=7)[0]
    num_samples, max_tokens = 4, 10
    sampling = c.SamplingParams(temperature=1.0, seed=99, n=num_samples, max_tokens=max_tokens, ignore_eos=True,
                                logprobs=2)
    (expected,) = LLM(checkpoint, **ENGINE_ARGS).generate(
        [prompt], SamplingParams(temperature=1.0, seed=99, n=num_samples, max_tokens=max_tokens, ignore_eos=True))
    decode, prefill = await start_decode(checkpoint), await start_prefill(checkpoint)
    try:
        reader = AttachReader(decode.stub)
        total = (await decode.stub.GetLoad(c.GetLoadRequest())).load.num_total_blocks
        admitted = await decode.stub.Admit(d.AdmitRequest(
            request_id="n4", prompt_token_ids=prompt, sampling=sampling, gateway_id=GATEWAY,
            prefill_worker_id="prefill-0"))
        num_blocks = -(-len(prompt) // 4)
        assert len(admitted.handle.block_ids) == num_blocks  # the prompt is reserved once
        assert (await decode.stub.GetLoad(c.GetLoadRequest())).load.num_free_blocks == total - num_blocks
        prefilled = await prefill_response(prefill.stub.Prefill(p.PrefillRequest(
            request_id="n4", prompt_token_ids=prompt, sampling=sampling, destination=admitted.handle)))
        assert list(prefilled.first_token_ids) == [s.token_ids[0] for s in expected.outputs]
        assert prefilled.num_computed_tokens == len(prompt) and prefilled.transfer.num_blocks == num_blocks
        assert [lp.sampled.token_id for lp in prefilled.first_token_logprobs] == list(prefilled.first_token_ids)
        await decode.stub.Start(d.StartRequest(
            request_id="n4", first_token_ids=prefilled.first_token_ids,
            first_token_logprobs=prefilled.first_token_logprobs, gateway_id=GATEWAY))
        await reader.wait_finished(["n4"], num_samples=num_samples)
        for index, sample in enumerate(expected.outputs):
            assert reader.tokens("n4", index) == sample.token_ids
            assert reader.finish("n4", index) == c.FINISH_REASON_LENGTH
            logprobs = [lp for x in reader.deltas("n4") if x.sample_index == index for lp in x.logprobs]
            assert [lp.sampled.token_id for lp in logprobs] == sample.token_ids
        assert len({tuple(s.token_ids) for s in expected.outputs}) > 1
        assert not decode.backend.engine.config.detokenize and not prefill.backend.engine.config.detokenize
        await wait_pool_full(decode.stub)
        await wait_pool_full(prefill.stub)
        await reader.cancel()
    finally:
        await decode.close()
        await prefill.close()
