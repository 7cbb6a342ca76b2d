"""The OpenAI JSON body parser keeps each option to its wire type's range, refuses JSON
booleans where numbers belong, and names the exact field (list position included) it refuses."""

from __future__ import annotations

import pytest

from cleave.errors import InvalidArgument
from cleave.generation.sampling_request import MAX_SAMPLES
from services.gateway.openai_request import (
    MAX_PROMPTS,
    MAX_UINT32,
    MAX_UINT64,
    CompletionEcho,
    completion_prompts,
    generate_spec,
)
from services.gateway.prompt_truncation import PromptTruncation


def completion(**options):
    spec, stream = generate_spec({"prompt": "hi", **options}, "r", "m", chat=False)
    return spec


def chat(**options):
    spec, stream = generate_spec({"messages": [{"role": "user", "content": "x"}], **options}, "r", "m", chat=True)
    return spec


def refused_field(build, **options) -> str:
    with pytest.raises(InvalidArgument) as raised:
        build(**options)
    return raised.value.field


@pytest.mark.parametrize("options, field", [
    ({"seed": True}, "seed"),
    ({"min_tokens": False}, "min_tokens"),
    ({"temperature": True}, "temperature"),
    ({"max_thinking_tokens": True}, "max_thinking_tokens"),
])
def test_booleans_are_not_numbers(options, field):
    assert refused_field(completion, **options) == field


@pytest.mark.parametrize("options, field", [
    ({"seed": -1}, "seed"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"max_thinking_tokens": -1}, "max_thinking_tokens"),
    ({"n": 0}, "n"),
    ({"max_tokens": 0}, "max_tokens"),
])
def test_values_below_the_range_are_refused(options, field):
    assert refused_field(completion, **options) == field


def test_the_top_of_each_range_is_accepted():
    spec = completion(seed=MAX_UINT64, n=MAX_SAMPLES, max_thinking_tokens=MAX_UINT32)
    assert (spec.sampling.seed, spec.sampling.n, spec.reasoning.max_thinking_tokens) == (MAX_UINT64, MAX_SAMPLES, MAX_UINT32)


def test_a_seed_wider_than_32_bits_is_accepted():
    assert completion(seed=2**40).sampling.seed == 2**40


def test_max_tokens_zero_is_accepted_only_with_echo():
    assert completion(max_tokens=0, echo=True).sampling.max_tokens == 1
    assert refused_field(completion, max_tokens=0, echo=False) == "max_tokens"


def test_max_completion_tokens_errors_name_that_field():
    assert refused_field(chat, max_completion_tokens=0) == "max_completion_tokens"


@pytest.mark.parametrize("options, field", [
    ({"stop_token_ids": [1, -1]}, "stop_token_ids[1]"),
    ({"stop": ["a", 3]}, "stop[1]"),
    ({"logit_bias": {"5": "x"}}, "logit_bias.5"),
])
def test_list_and_object_errors_name_the_item(options, field):
    assert refused_field(completion, **options) == field


def test_logit_bias_keys_must_be_ascii_digits():
    assert refused_field(completion, logit_bias={"\u0661\u0662": 1.0}) == "logit_bias"


def test_chat_logprobs_without_top_logprobs_asks_for_none_of_the_alternatives():
    assert chat(logprobs=True).sampling.logprobs == 0


def test_stream_must_be_a_boolean():
    assert refused_field(completion, stream="yes") == "stream"


def test_stream_options_need_a_stream():
    assert refused_field(completion, stream=False, stream_options={"include_usage": True}) == "stream_options"


def test_prompt_token_ids_must_not_be_negative():
    assert refused_field(completion_prompts_of, prompt=[1, -1]) == "prompt"


def test_an_empty_prompt_string_is_refused():
    assert refused_field(completion_prompts_of, prompt=["ok", ""]) == "prompt[1]"


def test_a_batch_of_max_prompts_is_accepted_and_one_more_refused():
    assert len(completion_prompts({"prompt": ["x"] * MAX_PROMPTS})) == MAX_PROMPTS
    assert refused_field(completion_prompts_of, prompt=["x"] * (MAX_PROMPTS + 1)) == "prompt"


def test_echo_scores_the_prompt_alone_only_for_max_tokens_zero():
    assert CompletionEcho.of({"echo": True, "max_tokens": 0}).prompt_only
    assert not CompletionEcho.of({"echo": True, "max_tokens": 5}).prompt_only


def completion_prompts_of(**body):
    return completion_prompts(body)


def test_a_boolean_max_tokens_is_refused_as_not_a_positive_integer():
    with pytest.raises(InvalidArgument, match="must be a positive integer, got True") as raised:
        completion(max_tokens=True)
    assert raised.value.field == "max_tokens"


def test_a_cache_salt_travels_in_the_sampling_params_and_must_be_a_non_empty_string():
    assert completion(cache_salt="tenant-a").sampling.cache_salt == "tenant-a"
    assert chat(cache_salt="tenant-a").sampling.cache_salt == "tenant-a"
    assert completion(cache_salt=None).sampling.cache_salt == "" == completion().sampling.cache_salt
    for bad in ("", 7, ["a"], True, "\ud800"):
        assert refused_field(completion, cache_salt=bad) == "cache_salt"
    assert refused_field(completion, cache_salt="x" * 257) == "sampling.cache_salt"  # 400 naming cache_salt
    assert completion(cache_salt="x" * 256).sampling.cache_salt == "x" * 256


def test_a_priority_travels_in_the_sampling_params_and_must_be_an_int32():
    assert completion(priority=-5).sampling.priority == -5
    assert chat(priority=2**31 - 1).sampling.priority == 2**31 - 1
    assert completion(priority=-(2**31)).sampling.priority == -(2**31)
    assert completion(priority=None).sampling.priority == 0 == completion().sampling.priority
    for bad in (True, 1.0, "1", [1], 2**31, -(2**31) - 1):
        assert refused_field(completion, priority=bad) == "priority"


@pytest.mark.parametrize("build, options, field", [
    # best_of must be a count: a negative one asked for nothing only by the "<= n" comparison
    (completion, {"best_of": -1}, "best_of"),
    (completion, {"best_of": -2**70}, "best_of"),
    (completion, {"best_of": 0}, "best_of"),
    (completion, {"best_of": 3, "n": 2}, "best_of"),
    # completions' fields on chat were never read there
    (chat, {"best_of": "x"}, "best_of"),
    (chat, {"best_of": 2}, "best_of"),
    (chat, {"echo": 5}, "echo"),
    (chat, {"echo": True}, "echo"),
    (chat, {"suffix": {"a": 1}}, "suffix"),
    (chat, {"suffix": "tail"}, "suffix"),
    # vLLM's extensions were ignored at any value
    *((build, {name: "x"}, name) for build in (completion, chat) for name in (
        "prompt_logprobs", "truncate_prompt_tokens", "include_stop_str_in_output", "add_special_tokens",
        "return_token_ids")),
    # vLLM's range: k >= 1, or -1 (as many as the context holds); 0 would keep an empty prompt
    *((build, {"truncate_prompt_tokens": bad}, "truncate_prompt_tokens") for build in (completion, chat)
      for bad in (0, -2, True, 1.5, [8])),
    # vLLM's truncation_side: only its default for generating models, the left, is served
    *((build, {"truncation_side": bad}, "truncation_side") for build in (completion, chat) for bad in ("right", "", 1)),
    # served ones are bounded as top_logprobs is, and prompt scores are never streamed (vLLM's too)
    *((build, {"prompt_logprobs": bad}, "prompt_logprobs") for build in (completion, chat) for bad in (-1, 21, True)),
    *((build, {"prompt_logprobs": 0, "stream": True}, "prompt_logprobs") for build in (completion, chat)),
    *((build, {name: 1}, name) for build in (completion, chat) for name in ("include_stop_str_in_output",
                                                                            "return_token_ids")),
    (completion, {"add_special_tokens": False}, "add_special_tokens"),
    (chat, {"add_special_tokens": True}, "add_special_tokens"),
    # at most 20 alternatives, whether or not logprobs asks for them
    (chat, {"top_logprobs": 21}, "top_logprobs"),
    (chat, {"top_logprobs": 21, "logprobs": False}, "top_logprobs"),
])
def test_fields_the_gateway_does_not_honour_are_refused_and_checked(build, options, field):
    assert refused_field(build, **options) == field


@pytest.mark.parametrize("build, options", [
    (completion, {"best_of": 1}),
    (completion, {"best_of": 2, "n": 2}),
    (completion, {"best_of": None, "suffix": "", "add_special_tokens": True}),
    (chat, {"best_of": 1, "echo": False, "suffix": None, "add_special_tokens": False}),
    *((build, {"prompt_logprobs": None, "truncate_prompt_tokens": None, "include_stop_str_in_output": False,
               "return_token_ids": False}) for build in (completion, chat)),
    *((build, {"truncate_prompt_tokens": 8, "truncation_side": side}) for build in (completion, chat)
      for side in ("left", None)),
    (chat, {"top_logprobs": 20}),
])
def test_their_no_op_values_are_accepted(build, options):
    build(**options)


@pytest.mark.parametrize("build", [completion, chat])
def test_vllms_served_extensions_reach_the_spec(build):
    spec = build(prompt_logprobs=20, return_token_ids=True, include_stop_str_in_output=True, truncate_prompt_tokens=8)
    assert spec.sampling.prompt_logprobs == 20 and spec.stream.include_prompt_token_ids and spec.include_stop_str
    assert spec.truncation == PromptTruncation(8)
    assert build(truncate_prompt_tokens=-1).truncation == PromptTruncation(-1)
    plain = build()
    assert plain.sampling.prompt_logprobs is None and not plain.stream.include_prompt_token_ids
    assert not plain.include_stop_str and plain.truncation is None


def test_an_echo_scores_its_prompt_with_prompt_logprobs_count_else_with_logprobs():
    assert completion(echo=True, logprobs=3).sampling.prompt_logprobs == 3  # vLLM's default
    assert completion(echo=True, logprobs=3, prompt_logprobs=1).sampling.prompt_logprobs == 1
    assert completion(logprobs=3).sampling.prompt_logprobs is None
