"""The OpenAI-compatible HTTP API, driven by the real `openai` client."""

from __future__ import annotations

import httpx
import openai
import pytest

from cleave.generation.sampling_params import SamplingParams
from tests.services.gateway.helpers import reference_llm

pytestmark = pytest.mark.asyncio(loop_scope="module")
MESSAGES = [{"role": "user", "content": "Why is the sky blue?"}]


def client(stack) -> openai.AsyncOpenAI:
    return stack.openai()  # closed with the stack


async def test_models(stack):
    models = await client(stack).models.list()
    assert [m.id for m in models.data] == ["tiny"]


async def test_completion_matches_the_engine(stack, model_dir):
    (reference,) = reference_llm(model_dir).generate("The quick brown fox", SamplingParams(max_tokens=8, temperature=0.0), raw=True)
    response = await client(stack).completions.create(
        model="tiny", prompt="The quick brown fox", max_tokens=8, temperature=0.0, extra_body={"reasoning_mode": "inline"}
    )
    assert response.choices[0].text == reference.outputs[0].reasoning_text  # no end tag: all of it is thinking
    assert response.choices[0].finish_reason == "length"
    assert response.usage.completion_tokens == 8
    assert response.usage.prompt_tokens == len(reference.prompt_token_ids)


async def test_chat_separates_reasoning_content(stack, model_dir):
    (reference,) = reference_llm(model_dir).generate(
        MESSAGES, SamplingParams(max_tokens=12, temperature=0.0, max_thinking_tokens=3)
    )
    response = await client(stack).chat.completions.create(
        model="tiny", messages=MESSAGES, max_completion_tokens=12, temperature=0.0, seed=3,
        extra_body={"max_thinking_tokens": 3},
    )
    message = response.choices[0].message
    assert message.content == reference.outputs[0].text
    assert message.reasoning_content == reference.outputs[0].reasoning_text
    assert response.usage.completion_tokens_details.reasoning_tokens == reference.outputs[0].num_reasoning_tokens


async def test_streaming_chat_deltas_add_up(stack):
    whole = await client(stack).chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=12, temperature=0.0, extra_body={"max_thinking_tokens": 3}
    )
    stream = await client(stack).chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=12, temperature=0.0, stream=True,
        stream_options={"include_usage": True}, extra_body={"max_thinking_tokens": 3},
    )
    content, reasoning, finish, usage = "", "", None, None
    async for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            content += choice.delta.content or ""
            reasoning += getattr(choice.delta, "reasoning_content", None) or ""
            finish = choice.finish_reason or finish
    assert (content, reasoning) == (whole.choices[0].message.content, whole.choices[0].message.reasoning_content)
    assert finish == "length"
    assert usage.completion_tokens == 12


async def test_n_and_logprobs(stack):
    response = await client(stack).chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=4, n=2, temperature=1.0, seed=1, logprobs=True, top_logprobs=2,
    )
    assert [choice.index for choice in response.choices] == [0, 1]
    for choice in response.choices:
        assert len(choice.logprobs.content) == 4
        assert all(len(entry.top_logprobs) == 2 and entry.logprob <= 0 for entry in choice.logprobs.content)


async def test_reasoning_effort_is_taken_and_checked(stack):
    """The openai client's own `reasoning_effort`: accepted (this tiny model's template ignores
    it; the template tests are in test_reasoning_effort.py), and a value outside low, medium,
    high is a 400 naming it."""
    response = await client(stack).chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=4, temperature=0.0, reasoning_effort="low")
    assert response.choices[0].finish_reason == "length"
    with pytest.raises(openai.BadRequestError) as bad:
        await client(stack).chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=4,
                                                    extra_body={"reasoning_effort": "extreme"})
    assert bad.value.status_code == 400 and bad.value.body["param"] == "reasoning_effort"


async def test_errors_are_openai_shaped(stack):
    with pytest.raises(openai.BadRequestError) as bad:
        await client(stack).chat.completions.create(model="tiny", messages=MESSAGES, temperature=-1)
    assert bad.value.status_code == 400 and bad.value.body["param"] == "temperature"
    with pytest.raises(openai.BadRequestError) as empty:
        await client(stack).chat.completions.create(model="tiny", messages=[])
    assert empty.value.body["param"] == "messages"
    with pytest.raises(openai.NotFoundError) as missing:
        await client(stack).completions.create(model="nope", prompt="hi")
    assert missing.value.status_code == 404 and missing.value.body["code"] == "model_not_found"
    async with httpx.AsyncClient() as http:
        response = await http.post(f"{stack.http_url}/completions", content=b"{not json")
    assert response.status_code == 400


@pytest.mark.parametrize("extra", [{"logprobs": "yes"}, {"logprobs": True, "top_logprobs": "5"},
                                   {"top_logprobs": [1]}, {"include_reasoning": 0}, {"user": {"id": 1}}])
async def test_flags_and_names_of_the_wrong_type_are_refused_naming_them(stack, extra):
    """OpenAI's booleans, counts and end-user id, sent with another JSON type: a 400 naming
    the field, not a request read as if the value were truthy (or never read)."""
    with pytest.raises(openai.BadRequestError) as bad:
        await client(stack).chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=2, extra_body=extra)
    assert bad.value.body["param"] == list(extra)[-1]
    response = await client(stack).chat.completions.create(  # the same fields, of their types
        model="tiny", messages=MESSAGES, max_tokens=2, logprobs=True, top_logprobs=2, user="end-user-7",
        extra_body={"include_reasoning": False})
    assert len(response.choices[0].logprobs.content[0].top_logprobs) == 2


async def test_logit_bias_reaches_every_token_and_min_tokens_outlasts_a_stop_string(stack, model_dir):
    """+100 on one token makes greedy output that token throughout (in disaggregated mode the
    prefill worker samples the first); a stop string the answer starts with cannot end it
    before `min_tokens`; both as the in-process engine generates them."""
    reference = reference_llm(model_dir)
    prompt, forced = "The quick brown fox", 42
    biased = await client(stack).completions.create(
        model="tiny", prompt=prompt, max_tokens=6, temperature=0.0, logit_bias={str(forced): 100},
        extra_body={"reasoning_mode": "inline"})
    assert biased.choices[0].text == reference.tokenizer.decode([forced] * 6)
    assert biased.usage.completion_tokens == 6
    (plain,) = reference.generate(prompt, SamplingParams(max_tokens=8, temperature=0.0), raw=True)
    stop = plain.outputs[0].reasoning_text[:1]  # the answer's first character
    for min_tokens in (0, 5):
        response = await client(stack).completions.create(
            model="tiny", prompt=prompt, max_tokens=8, temperature=0.0, stop=[stop],
            extra_body={"reasoning_mode": "inline", "min_tokens": min_tokens})
        (expected,) = reference.generate(prompt, SamplingParams(max_tokens=8, temperature=0.0, stop=[stop],
                                                                min_tokens=min_tokens), raw=True)
        assert response.choices[0].text == expected.outputs[0].reasoning_text
        assert response.usage.completion_tokens == len(expected.outputs[0].token_ids)
        assert (response.usage.completion_tokens >= 5) == (min_tokens == 5)
    for min_tokens in (0, 3):  # the forced token is a stop id too: it ends the sample once min_tokens allows
        response = await client(stack).completions.create(
            model="tiny", prompt=prompt, max_tokens=6, temperature=0.0, logit_bias={str(forced): 100},
            extra_body={"reasoning_mode": "inline", "stop_token_ids": [forced], "min_tokens": min_tokens})
        (expected,) = reference.generate(prompt, SamplingParams(
            max_tokens=6, temperature=0.0, logit_bias={forced: 100.0}, stop_token_ids=[forced],
            min_tokens=min_tokens), raw=True)
        assert (response.choices[0].finish_reason, response.usage.completion_tokens) == ("stop", min_tokens + 1)
        assert response.choices[0].text == expected.outputs[0].reasoning_text
        assert forced not in expected.outputs[0].token_ids[:min_tokens]
    with pytest.raises(openai.BadRequestError) as raised:
        await client(stack).completions.create(model="tiny", prompt=prompt, max_tokens=2, logit_bias={"999999": 1})
    assert raised.value.body["param"] == "logit_bias"
    # a stop id beyond the vocabulary is legal (it never comes) and nothing for min_tokens to mask
    beyond = await client(stack).completions.create(
        model="tiny", prompt=prompt, max_tokens=3, temperature=0.0,
        extra_body={"reasoning_mode": "inline", "stop_token_ids": [2**31 - 1], "min_tokens": 2})
    assert beyond.usage.completion_tokens == 3
