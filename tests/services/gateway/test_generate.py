"""The Gateway gRPC API over real in-process workers, in both modes."""

from __future__ import annotations

import asyncio

import grpc
import httpx
import pytest

from cleave.client import GatewayClient
from cleave.client.gateway import build_request, collect
from cleave.generation.sampling_params import SamplingParams
from cleave.proto.cleave.v1 import common_pb2 as c, gateway_pb2 as g
from cleave.rpc.errors import error_detail
from tests.services.gateway.helpers import free_blocks, reference_llm, wait_for_free_blocks, wait_for_no_running
from tests.services.gateway.stack import MAX_MODEL_LEN

pytestmark = pytest.mark.asyncio(loop_scope="module")
PROMPT = "The quick brown fox"
IDS = g.StreamOptions(include_token_ids=True)


async def test_list_models(stack):
    async with GatewayClient(stack.gateway_address) as client:
        (model,) = await client.list_models()
    assert (model.id, model.max_context_length, model.is_reasoning_model) == ("tiny", 256, True)


async def test_greedy_tokens_equal_the_in_process_engine(stack, model_dir):
    prompts = ["The quick brown fox", "Hello world!", "What is the capital of France?"]
    expected = reference_llm(model_dir).generate(prompts, SamplingParams(max_tokens=10, temperature=0.0))
    async with GatewayClient(stack.gateway_address) as client:
        results = await asyncio.gather(
            *(client.complete(p, max_tokens=10, temperature=0.0, stream=IDS) for p in prompts)
        )
    for result, reference in zip(results, expected):
        assert result.samples[0].token_ids == reference.outputs[0].token_ids
        assert result.samples[0].text == reference.outputs[0].text
        assert result.samples[0].reasoning_text == reference.outputs[0].reasoning_text
        assert result.usage.prompt_tokens == len(reference.prompt_token_ids)
        assert result.usage.completion_tokens == 10


async def test_reasoning_modes_split_the_same_tokens(stack, model_dir):
    tokenizer = reference_llm(model_dir).tokenizer
    results = {}
    async with GatewayClient(stack.gateway_address) as client:
        for mode in (c.REASONING_MODE_SEPARATE, c.REASONING_MODE_HIDDEN, c.REASONING_MODE_INLINE):
            results[mode] = await client.complete(
                PROMPT, max_tokens=12, temperature=0.0, stream=IDS,
                reasoning=c.ReasoningOptions(mode=mode, max_thinking_tokens=4),
            )
    separate = results[c.REASONING_MODE_SEPARATE]
    ids = separate.samples[0].token_ids
    end_tag = tokenizer.encode("</think>", add_special_tokens=False)
    assert ids[4:4 + len(end_tag)] == end_tag  # the budget closed thinking after 4 tokens
    assert separate.samples[0].reasoning_text == tokenizer.decode(ids[:4], skip_special_tokens=True)
    assert separate.usage.reasoning_tokens == 4 + len(end_tag)
    hidden = results[c.REASONING_MODE_HIDDEN].samples[0]
    assert (hidden.reasoning_text, hidden.text) == ("", separate.samples[0].text)
    inline = results[c.REASONING_MODE_INLINE].samples[0]
    assert inline.reasoning_text == ""
    assert inline.text == tokenizer.decode(ids, skip_special_tokens=True)
    assert inline.text == separate.samples[0].reasoning_text + "</think>" + separate.samples[0].text


async def test_stop_string_cuts_the_text(stack):
    async with GatewayClient(stack.gateway_address) as client:
        full = await client.complete(PROMPT, max_tokens=16, temperature=0.0, reasoning=c.ReasoningOptions(mode=c.REASONING_MODE_INLINE))
        text = full.samples[0].text
        stop = text[5:8]
        cut = await client.complete(PROMPT, max_tokens=16, temperature=0.0, stop=[stop],
                                    reasoning=c.ReasoningOptions(mode=c.REASONING_MODE_INLINE))
    assert cut.samples[0].text == text[: text.index(stop)]
    assert cut.samples[0].finish_reason == "stop"


async def test_n_samples_share_one_request(stack):
    async with GatewayClient(stack.gateway_address) as client:
        result = await client.complete(PROMPT, max_tokens=6, temperature=1.0, seed=7, n=3, ignore_eos=True, stream=IDS)
    assert [s.index for s in result.samples] == [0, 1, 2]
    assert all(len(s.token_ids) == 6 and s.finish_reason == "length" for s in result.samples)
    assert result.usage.completion_tokens == 18


async def test_an_aggregated_request_answers_once_with_what_it_would_have_streamed(stack):
    options = dict(max_tokens=24, temperature=0.0, n=2, logprobs=2)
    async with GatewayClient(stack.gateway_address) as client:
        streamed = [response async for response in client.stream(build_request(PROMPT, stream=IDS, **options))]
        (whole,) = [response async for response in client.stream(build_request(
            PROMPT, stream=g.StreamOptions(include_token_ids=True, aggregate=True), **options))]
    assert len(streamed) > 2  # several chunks, merged into the one answer
    for sample in whole.samples:
        deltas = [delta for response in streamed for delta in response.samples if delta.index == sample.index]
        assert sample.text == "".join(delta.text for delta in deltas)
        assert sample.reasoning_text == "".join(delta.reasoning_text for delta in deltas)
        assert list(sample.token_ids) == [token for delta in deltas for token in delta.token_ids]
        assert len(sample.logprobs) == len(sample.token_ids) == 24
        assert sample.finish_reason == deltas[-1].finish_reason != c.FINISH_REASON_UNSPECIFIED
    assert sorted(sample.index for sample in whole.samples) == [0, 1]


@pytest.mark.parametrize(
    ("request_kwargs", "code", "text"),
    [
        ({"temperature": -1.0}, grpc.StatusCode.INVALID_ARGUMENT, "sampling.temperature"),
        ({"model": "other"}, grpc.StatusCode.NOT_FOUND, "model 'other' is not served"),
        ({"max_tokens": 300}, grpc.StatusCode.INVALID_ARGUMENT, "sampling.max_tokens"),
    ],
)
async def test_bad_requests_fail_with_the_field(stack, request_kwargs, code, text):
    async with GatewayClient(stack.gateway_address) as client:
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            await client.complete(PROMPT, **request_kwargs)
    assert raised.value.code() == code
    assert text in raised.value.details()


async def test_empty_and_oversized_prompts_are_rejected(stack):
    async with GatewayClient(stack.gateway_address) as client:
        with pytest.raises(grpc.aio.AioRpcError) as empty:
            await collect(client.stream(g.GenerateRequest(text="")))
        with pytest.raises(grpc.aio.AioRpcError) as too_long:
            await client.complete([5] * 300, max_tokens=1)
        with pytest.raises(grpc.aio.AioRpcError) as vocabulary:
            await client.complete([5, 100_000], max_tokens=1)
    assert empty.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "text" in empty.value.details()
    assert too_long.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "input" in too_long.value.details()
    assert vocabulary.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "vocabulary" in vocabulary.value.details()


async def test_client_cancel_aborts_and_frees_blocks(stack):
    before = free_blocks(stack)
    async with GatewayClient(stack.gateway_address) as client:
        call = client.generate(PROMPT, max_tokens=200, ignore_eos=True, temperature=0.0)
        received = 0
        async for _ in call:
            received += 1
            if received == 2:
                call.cancel()
                break
    assert received == 2
    assert await wait_for_free_blocks(stack, before) == before
    assert await wait_for_no_running(stack) == {}


async def test_abort_rpc_ends_the_stream_with_abort(stack):
    before = free_blocks(stack)
    async with GatewayClient(stack.gateway_address) as client:
        call = client.stream(build_request(PROMPT, request_id="to-abort", max_tokens=200, ignore_eos=True))
        first = await anext(aiter(call))
        assert first.request_id == "to-abort"
        assert await client.abort("to-abort") is True
        result = await collect(call)
        assert await client.abort("to-abort") is False
    assert result.samples[0].finish_reason == "abort"
    assert await wait_for_free_blocks(stack, before) == before


async def test_deadline_aborts_with_deadline_exceeded(stack):
    before = free_blocks(stack)
    async with GatewayClient(stack.gateway_address) as client:
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            await client.complete(PROMPT, timeout=0.3, max_tokens=240, ignore_eos=True, n=8, temperature=1.0)
    assert raised.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert await wait_for_free_blocks(stack, before) == before


# ---- vLLM's extensions, served as the HTTP API serves them ------------------------------------

# head and tail differ, so keeping the wrong end answers differently
HEAD = "The quick brown fox jumps over the lazy dog. " * 12
TAIL = "Once upon a time there was a little green frog who sang all day long by the river"
KEEP = 24
GREEDY = dict(max_tokens=6, temperature=0.0, stream=IDS)


async def http_tokenize(stack, body: dict) -> list[int]:
    """The prompt's token ids as the gateway's tokenizer makes them (vLLM's /tokenize)."""
    async with httpx.AsyncClient() as http:
        response = await http.post(f"{stack.http_url.removesuffix('/v1')}/tokenize", json={"model": "tiny", **body})
    assert response.status_code == 200, response.text
    return response.json()["tokens"]


async def greedy_run(client: GatewayClient, prompt, **options) -> tuple[list[int], int, list[int]]:
    """(sampled token ids, prompt tokens counted, the prompt's token ids as run) of one greedy
    request."""
    responses = [response async for response in client.stream(build_request(prompt, prompt_logprobs=0,
                                                                            **{**GREEDY, **options}))]
    sampled = [token for response in responses for sample in response.samples for token in sample.token_ids]
    prompt_ids = [token for response in responses for token in response.prompt_token_ids]
    return sampled, responses[-1].usage.prompt_tokens, prompt_ids


async def test_truncation_runs_a_prompt_as_its_last_tokens(stack):
    text_ids = await http_tokenize(stack, {"prompt": HEAD + TAIL, "add_special_tokens": True})
    messages = [{"role": "system", "content": HEAD}, {"role": "user", "content": TAIL}]
    chat_ids = await http_tokenize(stack, {"messages": messages})
    assert len(text_ids) > MAX_MODEL_LEN and len(chat_ids) > MAX_MODEL_LEN
    async with GatewayClient(stack.gateway_address) as client:
        with pytest.raises(grpc.aio.AioRpcError) as whole:  # it does not fit untruncated
            await greedy_run(client, HEAD + TAIL, raw=True)
        for prompt, full_ids, raw in ((HEAD + TAIL, text_ids, True), (messages, chat_ids, False)):
            cut = await greedy_run(client, prompt, raw=raw, truncate_prompt_tokens=KEEP)
            tail = await greedy_run(client, full_ids[-KEEP:])
            head = await greedy_run(client, full_ids[:KEEP])
            assert cut == tail and cut[1:] == (KEEP, full_ids[-KEEP:])
            assert cut[0] != head[0]
    assert whole.value.code() == grpc.StatusCode.INVALID_ARGUMENT and error_detail(whole.value).field == "input"


async def test_truncation_minus_one_keeps_what_fits_of_a_token_id_prompt_past_the_context(stack):
    prompt_ids = list(range(1, 2 * MAX_MODEL_LEN))
    kept = prompt_ids[-(MAX_MODEL_LEN - 5):]
    async with GatewayClient(stack.gateway_address) as client:
        fit = await greedy_run(client, prompt_ids, truncate_prompt_tokens=-1, max_tokens=5)
        direct = await greedy_run(client, kept, max_tokens=5)
        short = await greedy_run(client, prompt_ids[:8], truncate_prompt_tokens=KEEP)
    assert fit == direct and fit[1:] == (MAX_MODEL_LEN - 5, kept)
    assert short[1] == 8  # no longer than asked: whole


async def test_bad_truncation_counts_are_refused_by_name(stack):
    # out of vLLM's range; then over what the context holds beside max_tokens, however short the prompt
    async with GatewayClient(stack.gateway_address) as client:
        for value in (0, -2, MAX_MODEL_LEN - 1):
            with pytest.raises(grpc.aio.AioRpcError) as raised:
                await client.complete(PROMPT, max_tokens=2, truncate_prompt_tokens=value)
            assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT, value
            assert error_detail(raised.value).field == "truncate_prompt_tokens", raised.value.details()
        fits = await client.complete(PROMPT, max_tokens=2, ignore_eos=True, truncate_prompt_tokens=MAX_MODEL_LEN - 2)
    assert fits.usage.completion_tokens == 2


async def test_include_stop_str_in_output_keeps_the_stop_string(stack):
    inline = c.ReasoningOptions(mode=c.REASONING_MODE_INLINE)
    async with GatewayClient(stack.gateway_address) as client:
        full = await client.complete(PROMPT, max_tokens=16, temperature=0.0, reasoning=inline)
        text = full.samples[0].text
        stop = text[5:8]
        end = text.index(stop)
        for include, expected in ((True, text[:end + len(stop)]), (False, text[:end])):
            cut = await client.complete(PROMPT, max_tokens=16, temperature=0.0, stop=[stop], reasoning=inline,
                                        include_stop_str_in_output=include)
            assert (cut.samples[0].text, cut.samples[0].finish_reason) == (expected, "stop"), include
