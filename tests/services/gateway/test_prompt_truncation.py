"""vLLM's `truncate_prompt_tokens`: a prompt longer than the context keeps its last k tokens
(the templated prompt's, for chat), which alone run, are counted and are scored; values out
of vLLM's range, or over what the context holds beside the answer, are 400s naming the field.
The live tests run on a disaggregated and a colocated stack."""

from __future__ import annotations

import httpx
import openai
import pytest

from cleave.errors import InvalidArgument
from cleave.generation.sampling_params import SamplingParams
from services.gateway.prompt_truncation import PromptTruncation
from tests.services.gateway.stack import MAX_MODEL_LEN

live = pytest.mark.asyncio(loop_scope="module")
# head and tail differ, so keeping the wrong end answers differently
HEAD = "The quick brown fox jumps over the lazy dog. " * 12
TAIL = "Once upon a time there was a little green frog who sang all day long by the river"
LONG = HEAD + TAIL
KEEP = 24


def client(stack) -> openai.AsyncOpenAI:
    return stack.openai()  # closed with the stack


async def tokenize(stack, body: dict) -> list[int]:
    async with httpx.AsyncClient() as http:
        response = await http.post(f"{stack.http_url.removesuffix('/v1')}/tokenize", json={"model": "tiny", **body})
    assert response.status_code == 200, response.text
    return response.json()["tokens"]


def greedy(max_tokens: int = 6, **extra_body) -> dict:
    return {"model": "tiny", "max_tokens": max_tokens, "temperature": 0.0, "extra_body": extra_body}


def test_the_last_tokens_are_kept():
    assert PromptTruncation(3).apply(list(range(10)), 16, SamplingParams(max_tokens=4)) == [7, 8, 9]
    assert PromptTruncation(3).apply([1, 2], 16, SamplingParams(max_tokens=4)) == [1, 2]  # short: whole


def test_minus_one_keeps_what_the_context_holds_beside_the_answer():
    prompt = list(range(40))
    assert PromptTruncation(-1).apply(prompt, 16, SamplingParams(max_tokens=4)) == prompt[-12:]
    assert PromptTruncation(-1).apply(prompt, 16, SamplingParams(max_tokens=None)) == prompt[-15:]  # one token's room
    assert PromptTruncation(-1).apply(prompt, 16, SamplingParams(max_tokens=None, min_tokens=6)) == prompt[-10:]
    # the answer alone fills the context: nothing kept, the length check names max_tokens
    assert PromptTruncation(-1).apply(prompt, 16, SamplingParams(max_tokens=16)) == prompt


def test_a_count_over_what_the_context_holds_beside_the_answer_is_refused_whatever_the_prompt():
    assert PromptTruncation(12).apply([1, 2], 16, SamplingParams(max_tokens=4)) == [1, 2]
    with pytest.raises(InvalidArgument) as raised:
        PromptTruncation(13).apply([1, 2], 16, SamplingParams(max_tokens=4))
    assert raised.value.field == "truncate_prompt_tokens" and "at most 12" in raised.value.message


@live
async def test_a_prompt_too_long_for_the_context_runs_as_its_last_tokens(stack):
    prompt_ids = await tokenize(stack, {"prompt": LONG, "add_special_tokens": True})
    assert len(prompt_ids) > MAX_MODEL_LEN
    with pytest.raises(openai.BadRequestError) as raised:  # whole, it does not fit
        await client(stack).completions.create(prompt=LONG, **greedy())
    assert raised.value.body["param"] == "prompt"
    cut = await client(stack).completions.create(prompt=LONG, **greedy(truncate_prompt_tokens=KEEP,
                                                                       return_token_ids=True))
    tail = await client(stack).completions.create(prompt=prompt_ids[-KEEP:], **greedy())
    head = await client(stack).completions.create(prompt=prompt_ids[:KEEP], **greedy())
    assert cut.usage.prompt_tokens == KEEP and cut.choices[0].prompt_token_ids == prompt_ids[-KEEP:]
    assert cut.choices[0].text == tail.choices[0].text != head.choices[0].text


@live
async def test_a_token_id_prompt_and_minus_one_keep_the_last_tokens_that_fit(stack):
    prompt_ids = list(range(1, 2 * MAX_MODEL_LEN))
    fit = await client(stack).completions.create(prompt=prompt_ids, **greedy(5, truncate_prompt_tokens=-1,
                                                                            return_token_ids=True))
    assert fit.usage.prompt_tokens == MAX_MODEL_LEN - 5
    assert fit.choices[0].prompt_token_ids == prompt_ids[-(MAX_MODEL_LEN - 5):]
    short = await client(stack).completions.create(prompt=prompt_ids[:8], **greedy(truncate_prompt_tokens=KEEP))
    assert short.usage.prompt_tokens == 8  # no longer than asked: whole


@live
async def test_a_chat_keeps_the_last_tokens_of_its_templated_prompt(stack):
    messages = [{"role": "system", "content": HEAD}, {"role": "user", "content": TAIL}]
    prompt_ids = await tokenize(stack, {"messages": messages})
    assert len(prompt_ids) > MAX_MODEL_LEN
    options = greedy(truncate_prompt_tokens=KEEP, return_token_ids=True)
    chat = await client(stack).chat.completions.create(messages=messages, **options)
    tail = await client(stack).completions.create(prompt=prompt_ids[-KEEP:], **greedy(return_token_ids=True))
    assert chat.usage.prompt_tokens == KEEP and chat.prompt_token_ids == prompt_ids[-KEEP:]
    assert chat.choices[0].token_ids == tail.choices[0].token_ids
    stream = await client(stack).chat.completions.create(messages=messages, stream=True,
                                                         stream_options={"include_usage": True}, **options)
    chunks = [chunk async for chunk in stream]
    assert chunks[0].prompt_token_ids == prompt_ids[-KEEP:] and chunks[-1].usage.prompt_tokens == KEEP


@live
async def test_an_echo_returns_the_prompt_as_sent_and_scores_the_kept_tokens(stack):
    # as vLLM: the echoed text is the request's prompt; its logprobs are the tokens that ran
    answer = await client(stack).completions.create(prompt=LONG, echo=True, logprobs=0,
                                                    **greedy(0, truncate_prompt_tokens=KEEP))
    choice = answer.choices[0]
    assert choice.text == LONG and answer.usage.prompt_tokens == KEEP
    assert len(choice.logprobs.tokens) == KEEP and choice.logprobs.token_logprobs[0] is None
    assert "".join(choice.logprobs.tokens).endswith(TAIL[-20:])


@live
@pytest.mark.parametrize("chat", [False, True])
async def test_bad_counts_are_refused_by_name(stack, chat):
    create = client(stack).chat.completions.create if chat else client(stack).completions.create
    body = {"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": "hi"}
    # out of vLLM's range or type; then over the context beside max_tokens, however short the prompt
    for value, max_tokens in ((0, 2), (-2, 2), (True, 2), ("8", 2), (1.5, 2), (MAX_MODEL_LEN - 1, 2)):
        with pytest.raises(openai.BadRequestError) as raised:
            await create(**body, **greedy(max_tokens, truncate_prompt_tokens=value))
        assert raised.value.body["param"] == "truncate_prompt_tokens", (value, raised.value.body)
    fits = await create(**body, **greedy(2, truncate_prompt_tokens=MAX_MODEL_LEN - 2))
    assert fits.usage.completion_tokens == 2
