"""The parts of the OpenAI HTTP API that clients beyond chat rely on: lm-eval's harness
(echo, prompt logprobs, batches of prompts, /tokenize), vLLM's extensions (`prompt_logprobs`,
`return_token_ids`, `include_stop_str_in_output`) in vLLM's response shapes, model lookup,
OpenAI-shaped errors for every path, and refusing what the gateway cannot honour. Each test
runs on a disaggregated and a colocated stack."""

from __future__ import annotations

import httpx
import openai
import pytest
import torch

from cleave.generation.sampling_params import SamplingParams
from tests.services.gateway.helpers import reference_llm

pytestmark = pytest.mark.asyncio(loop_scope="module")
CONTEXT = "The quick brown fox"
CONTINUATION = " jumps over the lazy dog"


def client(stack) -> openai.AsyncOpenAI:
    return stack.openai()  # closed with the stack


def root(stack) -> str:
    return stack.http_url.removesuffix("/v1")


@pytest.fixture(scope="module")
def hf_model(model_dir):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def hf_continuation_logprob(hf_model, context_ids: list[int], continuation_ids: list[int]) -> float:
    """transformers' summed logprob of `continuation_ids` after `context_ids`."""
    ids = context_ids + continuation_ids
    with torch.no_grad():
        logprobs = torch.log_softmax(hf_model(torch.tensor([ids])).logits[0].float(), dim=-1)
    return sum(logprobs[p - 1, ids[p]].item() for p in range(len(context_ids), len(ids)))


async def tokenize(stack, text: str, add_special_tokens: bool = False) -> list[int]:
    async with httpx.AsyncClient() as http:
        response = await http.post(f"{root(stack)}/tokenize", json={"model": "tiny", "prompt": text,
                                                                     "add_special_tokens": add_special_tokens})
    assert response.status_code == 200, response.text
    return response.json()["tokens"]


async def test_lm_eval_loglikelihood_requests_score_the_continuation(stack, model_dir, hf_model):
    # lm-eval's local-completions: token-id prompts (context + continuation), echo, logprobs 1,
    # sums token_logprobs[ctxlen:-1] with max_tokens 1; the same with max_tokens 0 and [ctxlen:]
    context, continuation = await tokenize(stack, CONTEXT), await tokenize(stack, CONTINUATION)
    short = context[:2]
    prompts = [context + continuation, short + continuation]
    expected = [hf_continuation_logprob(hf_model, context, continuation),
                hf_continuation_logprob(hf_model, short, continuation)]
    (engine,) = reference_llm(model_dir).generate(prompts[0], SamplingParams(max_tokens=1, prompt_logprobs=1))
    engine_sum = sum(entry.logprob for entry in engine.prompt_logprobs[len(context):])
    for max_tokens, stop in ((1, -1), (0, None)):
        response = await client(stack).completions.create(
            model="tiny", prompt=prompts, echo=True, max_tokens=max_tokens, logprobs=1, temperature=0.0, seed=1)
        assert [choice.index for choice in response.choices] == [0, 1]
        for choice, prompt, context_ids, want in zip(response.choices, prompts, (context, short), expected):
            logprobs = choice.logprobs
            assert len(logprobs.tokens) == len(prompt) + max_tokens
            assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
            scored = logprobs.token_logprobs[len(context_ids):stop]
            assert sum(scored) == pytest.approx(want, abs=1e-3)
            for value, top in zip(scored, logprobs.top_logprobs[len(context_ids):stop]):
                assert len(top) == 1 and max(top.values()) >= value - 1e-6  # lm-eval's is_greedy reads this
            assert logprobs.text_offset[0] == 0 and logprobs.text_offset == sorted(logprobs.text_offset)
        assert sum(response.choices[0].logprobs.token_logprobs[len(context):stop]) == pytest.approx(engine_sum, abs=1e-4)
    assert response.usage.completion_tokens == 0
    assert response.usage.prompt_tokens == sum(len(prompt) for prompt in prompts)
    assert response.choices[0].text == CONTEXT + CONTINUATION  # echo alone: the prompt's text


async def test_the_echo_of_a_one_token_prompt_lists_that_token_scored_null(stack):
    # such a prompt has no scores for a worker to send, and its echo listed no tokens at all
    token_id = 42
    for max_tokens in (0, 1):
        response = await client(stack).completions.create(
            model="tiny", prompt=[token_id], echo=True, max_tokens=max_tokens, logprobs=1, temperature=0.0)
        logprobs = response.choices[0].logprobs
        assert len(logprobs.tokens) == 1 + max_tokens, logprobs
        assert response.choices[0].text.startswith(logprobs.tokens[0]) and logprobs.tokens[0]
        assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
        assert logprobs.text_offset[0] == 0


async def test_a_list_of_prompts_gets_one_choice_per_prompt_in_order(stack):
    prompts = ["The quick brown fox", "Why is the sky", "Once upon a time there"]
    batch = await client(stack).completions.create(model="tiny", prompt=prompts, max_tokens=4, temperature=0.0, n=2)
    assert [choice.index for choice in batch.choices] == list(range(6))
    for position, prompt in enumerate(prompts):
        single = await client(stack).completions.create(model="tiny", prompt=prompt, max_tokens=4, temperature=0.0)
        assert batch.choices[2 * position].text == batch.choices[2 * position + 1].text == single.choices[0].text
    assert batch.usage.completion_tokens == 6 * 4


async def test_a_raw_completion_returns_the_thinking_text_too(stack, model_dir):
    (reference,) = reference_llm(model_dir).generate(CONTEXT, SamplingParams(max_tokens=8, temperature=0.0), raw=True)
    response = await client(stack).completions.create(model="tiny", prompt=CONTEXT, max_tokens=8, temperature=0.0)
    whole = reference.outputs[0].reasoning_text + reference.outputs[0].text
    assert response.choices[0].text == whole and whole  # nothing dropped as "reasoning"


async def test_completion_text_offsets_index_the_text(stack):
    response = await client(stack).completions.create(model="tiny", prompt=CONTEXT, max_tokens=6, temperature=0.0,
                                                      logprobs=2)
    logprobs = response.choices[0].logprobs
    assert len(logprobs.text_offset) == len(logprobs.tokens) == 6
    offsets = [sum(len(token) for token in logprobs.tokens[:i]) for i in range(6)]
    assert logprobs.text_offset == offsets


async def test_tokenize_and_detokenize_round_trip(stack, model_dir):
    tokens = await tokenize(stack, CONTEXT)
    assert tokens == reference_llm(model_dir).tokenizer.encode(CONTEXT, add_special_tokens=False)
    async with httpx.AsyncClient() as http:
        counted = (await http.post(f"{root(stack)}/tokenize", json={"messages": [{"role": "user", "content": "hi"}]})).json()
        text = (await http.post(f"{root(stack)}/detokenize", json={"tokens": tokens})).json()
        bad = await http.post(f"{root(stack)}/detokenize", json={"tokens": [10**6]})
        # more tokens than the context holds: decoding millions of them held the gateway's GIL for seconds
        too_many = await http.post(f"{root(stack)}/detokenize", json={"tokens": tokens * counted["max_model_len"]})
    assert counted["count"] == len(counted["tokens"]) > 1 and counted["max_model_len"] > 0
    assert text == {"prompt": CONTEXT}
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    assert too_many.status_code == 400 and too_many.json()["error"]["param"] == "tokens"
    assert str(counted["max_model_len"]) in too_many.json()["error"]["message"]


async def test_a_model_is_looked_up_by_id(stack):
    model = await client(stack).models.retrieve("tiny")
    assert model.id == "tiny" and model.object == "model"
    with pytest.raises(openai.NotFoundError) as raised:
        await client(stack).models.retrieve("other/model")
    assert raised.value.body["code"] == "model_not_found"


async def test_unknown_paths_and_methods_answer_openai_shaped_json(stack):
    async with httpx.AsyncClient() as http:
        missing = await http.post(f"{stack.http_url}/embeddings", json={})
        wrong_method = await http.get(f"{stack.http_url}/completions")
    assert missing.status_code == 404
    assert set(missing.json()["error"]) == {"message", "type", "param", "code"}
    assert "/v1/embeddings" in missing.json()["error"]["message"]
    assert wrong_method.status_code == 405 and wrong_method.json()["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize("field, value", [
    ("tools", [{"type": "function", "function": {"name": "f", "parameters": {}}}]),
    ("tool_choice", "required"),
    ("functions", [{"name": "f", "parameters": {}}]),
    ("modalities", ["audio"]),
])
async def test_what_cannot_be_honoured_is_refused_by_name(stack, field, value):
    with pytest.raises(openai.BadRequestError) as raised:
        await client(stack).chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2, extra_body={field: value})
    assert raised.value.body["param"] == field


async def test_harmless_fields_and_no_op_values_are_accepted(stack):
    response = await client(stack).chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2, user="someone",
        tool_choice="none", response_format={"type": "text"}, extra_body={"tools": None})
    assert response.choices[0].finish_reason == "length"


async def test_null_content_is_refused_naming_the_message(stack):
    with pytest.raises(openai.BadRequestError) as raised:
        await client(stack).chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hi"}, {"role": "user", "content": None}], max_tokens=2)
    assert raised.value.body["param"] == "messages[1].content"


async def test_max_tokens_zero_needs_echo(stack):
    with pytest.raises(openai.BadRequestError) as raised:
        await client(stack).completions.create(model="tiny", prompt=CONTEXT, max_tokens=0)
    assert raised.value.body["param"] == "max_tokens"


async def test_grpc_generate_returns_the_prompts_scores_once(stack, model_dir):
    from cleave.client import GatewayClient

    prompt = [5, 17, 42, 9, 33, 71, 2, 88]
    (engine,) = reference_llm(model_dir).generate(prompt, SamplingParams(max_tokens=1, prompt_logprobs=2))
    async with GatewayClient(stack.gateway_address) as grpc_client:
        responses = [r async for r in grpc_client.generate(prompt, max_tokens=3, temperature=0.0, prompt_logprobs=2)]
    scored = [r for r in responses if r.prompt_logprobs]
    assert len(scored) == 1 and list(scored[0].prompt_token_ids) == prompt
    assert [e.sampled.token_id for e in scored[0].prompt_logprobs] == prompt[1:]
    assert [e.sampled.logprob for e in scored[0].prompt_logprobs] == pytest.approx(
        [entry.logprob for entry in engine.prompt_logprobs[1:]], abs=1e-4)
    assert all(len(e.top) == 2 for e in scored[0].prompt_logprobs)


async def test_completion_prompt_logprobs_are_vllms_on_each_choice_and_score_as_the_echo_does(stack):
    prompts = [[5, 17, 42, 9, 33, 71], [88, 14, 60]]
    answer = await client(stack).completions.create(model="tiny", prompt=prompts, max_tokens=2, temperature=0.0, n=2,
                                                    extra_body={"prompt_logprobs": 2})
    echo = await client(stack).completions.create(model="tiny", prompt=prompts, echo=True, max_tokens=0, logprobs=2,
                                                  temperature=0.0)
    assert [choice.index for choice in answer.choices] == [0, 1, 2, 3]
    for choice in answer.choices:  # choice i * n + j: sample j of prompt i
        prompt, echoed = prompts[choice.index // 2], echo.choices[choice.index // 2].logprobs
        scores = choice.prompt_logprobs
        assert scores[0] is None and len(scores) == len(prompt)
        for token_id, position, logprob, token, top in zip(
                prompt[1:], scores[1:], echoed.token_logprobs[1:], echoed.tokens[1:], echoed.top_logprobs[1:]):
            first_key, scored = next(iter(position.items()))  # the prompt token comes first
            assert first_key == str(token_id) and scored["decoded_token"] == token
            assert scored["logprob"] == pytest.approx(logprob, abs=1e-4)
            ranked = sorted(position.values(), key=lambda entry: entry["rank"])
            assert [entry["rank"] for entry in ranked][:2] == [1, 2] and len(position) in (2, 3)
            assert ranked[0]["logprob"] == pytest.approx(max(top.values()), abs=1e-4)
            # a prompt token among the two most likely is listed once; any other ranks below them
            assert (scored["rank"] <= 2) == (len(position) == 2)
            assert scored["rank"] <= 2 or scored["logprob"] <= ranked[1]["logprob"]
    assert answer.choices[0].prompt_logprobs == answer.choices[1].prompt_logprobs
    assert echo.choices[0].prompt_logprobs[1:] and all(len(position) <= 3 for position in echo.choices[0].prompt_logprobs[1:])


async def test_chat_prompt_logprobs_and_prompt_token_ids_are_vllms_top_level_fields(stack):
    response = await client(stack).chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=3, temperature=0.0, n=2,
        extra_body={"prompt_logprobs": 0, "return_token_ids": True})
    prompt, scores = response.prompt_token_ids, response.prompt_logprobs
    assert len(prompt) == len(scores) == response.usage.prompt_tokens and scores[0] is None
    assert [list(position) for position in scores[1:]] == [[str(token_id)] for token_id in prompt[1:]]
    echo = await client(stack).completions.create(model="tiny", prompt=prompt, echo=True, max_tokens=0, logprobs=0,
                                                  temperature=0.0)
    assert [position[str(token_id)]["logprob"] for token_id, position in zip(prompt[1:], scores[1:])] == pytest.approx(
        echo.choices[0].logprobs.token_logprobs[1:], abs=1e-4)
    assert all(position[str(token_id)]["rank"] >= 1 for token_id, position in zip(prompt[1:], scores[1:]))
    assert [len(choice.token_ids) for choice in response.choices] == [3, 3]
    assert sum(len(choice.token_ids) for choice in response.choices) == response.usage.completion_tokens


async def test_return_token_ids_whole_and_streamed_as_vllm_does(stack, model_dir):
    (reference,) = reference_llm(model_dir).generate(CONTEXT, SamplingParams(max_tokens=4, temperature=0.0), raw=True)
    options = {"model": "tiny", "max_tokens": 4, "temperature": 0.0, "extra_body": {"return_token_ids": True}}
    whole = await client(stack).completions.create(prompt=CONTEXT, **options)
    chunks = [chunk async for chunk in await client(stack).completions.create(prompt=CONTEXT, stream=True, **options)]
    assert whole.choices[0].prompt_token_ids == await tokenize(stack, CONTEXT, add_special_tokens=True)
    assert whole.choices[0].token_ids == list(reference.outputs[0].token_ids)
    # a choice's first chunk carries the prompt's ids, the later ones null; each its new ids
    assert chunks[0].choices[0].prompt_token_ids == whole.choices[0].prompt_token_ids
    assert all(chunk.choices[0].prompt_token_ids is None for chunk in chunks[1:])
    assert [token_id for chunk in chunks for token_id in chunk.choices[0].token_ids] == whole.choices[0].token_ids
    scored = await client(stack).completions.create(prompt=CONTEXT, echo=True, **{**options, "max_tokens": 0})
    assert scored.choices[0].prompt_token_ids == whole.choices[0].prompt_token_ids
    assert scored.choices[0].token_ids == []  # the prompt scored alone: the sampled token is left out

    messages = [{"role": "user", "content": "hi"}]
    chat = await client(stack).chat.completions.create(messages=messages, **options)
    stream = await client(stack).chat.completions.create(messages=messages, stream=True, **options)
    chat_chunks = [chunk async for chunk in stream]
    assert chat_chunks[0].prompt_token_ids == chat.prompt_token_ids and len(chat.prompt_token_ids) > 1
    assert all(getattr(chunk, "prompt_token_ids", None) is None for chunk in chat_chunks[1:])
    streamed = [token_id for chunk in chat_chunks for token_id in chunk.choices[0].token_ids]
    assert streamed == chat.choices[0].token_ids and len(streamed) == 4


async def test_include_stop_str_in_output_keeps_the_stop_string_whole_and_streamed(stack):
    plain = await client(stack).completions.create(model="tiny", prompt=CONTEXT, max_tokens=8, temperature=0.0)
    text = plain.choices[0].text
    stop = text[len(text) // 2:][:2]
    end = text.find(stop)
    assert len(stop) == 2 and end >= 0, text
    for include, expected in ((True, text[:end + len(stop)]), (False, text[:end])):
        options = {"model": "tiny", "prompt": CONTEXT, "max_tokens": 8, "temperature": 0.0, "stop": [stop],
                   "extra_body": {"include_stop_str_in_output": include}}
        whole = await client(stack).completions.create(**options)
        chunks = [chunk async for chunk in await client(stack).completions.create(stream=True, **options)]
        assert whole.choices[0].text == expected and whole.choices[0].finish_reason == "stop"
        assert "".join(chunk.choices[0].text for chunk in chunks) == expected


@pytest.mark.parametrize("chat", [False, True])
async def test_prompt_logprobs_are_refused_in_a_stream_and_out_of_bounds(stack, chat):
    create = client(stack).chat.completions.create if chat else client(stack).completions.create
    body = {"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": CONTEXT}
    for stream, value in ((True, 1), (False, 21), (False, -1)):
        with pytest.raises(openai.BadRequestError) as raised:
            await create(model="tiny", max_tokens=2, stream=stream, extra_body={"prompt_logprobs": value}, **body)
        assert raised.value.body["param"] == "prompt_logprobs"
    with pytest.raises(openai.BadRequestError) as raised:
        await create(model="tiny", max_tokens=2, extra_body={"return_token_ids": "yes"}, **body)
    assert raised.value.body["param"] == "return_token_ids"
