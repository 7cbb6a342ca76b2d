"""SamplingParams.validate: every bad field is rejected by name; good params pass."""

from __future__ import annotations

import pytest

from cleave.errors import CleaveError, InvalidArgument
from cleave.generation.sampling_params import SamplingParams


def test_defaults_and_typical_params_are_valid():
    SamplingParams().validate()
    SamplingParams(
        max_tokens=100, temperature=0.0, top_p=1.0, top_k=-1, min_p=1.0, seed=-1, n=4,
        logprobs=20, repetition_penalty=1.3, frequency_penalty=-2.0, presence_penalty=2.0,
        stop=["\n\n"], stop_token_ids=[0], max_thinking_tokens=10, min_thinking_tokens=10,
    ).validate(max_model_len=200, prompt_len=100)


@pytest.mark.parametrize(
    "options, field",
    [
        (dict(temperature=-0.1), "temperature"),
        (dict(temperature=float("nan")), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.01), "top_p"),
        (dict(top_k=-2), "top_k"),
        (dict(top_k=2.5), "top_k"),
        (dict(min_p=-0.01), "min_p"),
        (dict(min_p=1.5), "min_p"),
        (dict(n=0), "n"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(logprobs=-1), "logprobs"),
        (dict(logprobs=21), "logprobs"),
        (dict(repetition_penalty=0.0), "repetition_penalty"),
        (dict(frequency_penalty=2.5), "frequency_penalty"),
        (dict(presence_penalty=-2.01), "presence_penalty"),
        (dict(seed=2**64), "seed"),
        (dict(stop=["ok", ""]), "stop"),
        (dict(stop="abc"), "stop"),
        (dict(stop=[f"stop {i}" for i in range(65)]), "stop"),
        (dict(stop=["ok", "x" * 1025]), "stop"),
        (dict(stop_token_ids=[-3]), "stop_token_ids"),
        (dict(max_thinking_tokens=-1), "max_thinking_tokens"),
        (dict(min_thinking_tokens=-1), "min_thinking_tokens"),
        (dict(min_thinking_tokens=5, max_thinking_tokens=4), "min_thinking_tokens"),
        (dict(n=True), "n"),
    ],
)
def test_invalid_field_is_named(options, field):
    with pytest.raises(InvalidArgument) as info:
        SamplingParams(**options).validate()
    assert info.value.field == field
    assert isinstance(info.value, CleaveError)
    assert info.value.status_code == "INVALID_ARGUMENT"
    assert str(info.value).startswith(f"{field}: ")


def test_stop_strings_up_to_the_length_limit_are_taken():
    SamplingParams(stop=["x" * 1024] * 64).validate()


def test_length_against_context_window():
    SamplingParams(max_tokens=28).validate(max_model_len=128, prompt_len=100)
    with pytest.raises(InvalidArgument) as info:
        SamplingParams(max_tokens=29).validate(max_model_len=128, prompt_len=100)
    assert info.value.field == "max_tokens" and "at most 28" in info.value.message
    with pytest.raises(InvalidArgument) as info:
        SamplingParams(max_tokens=None).validate(max_model_len=128, prompt_len=128)
    assert info.value.field == "prompt"
    SamplingParams(max_tokens=None).validate(max_model_len=128, prompt_len=127)


def test_min_tokens_against_context_window():
    SamplingParams(max_tokens=None, min_tokens=28).validate(max_model_len=128, prompt_len=100)
    with pytest.raises(InvalidArgument) as info:  # no max_tokens: the context would end it sooner
        SamplingParams(max_tokens=None, min_tokens=29).validate(max_model_len=128, prompt_len=100)
    assert info.value.field == "min_tokens" and "at most 28" in info.value.message


def test_max_new_tokens_and_greedy():
    assert SamplingParams(max_tokens=None).max_new_tokens(128, 100) == 28
    assert SamplingParams(max_tokens=10).max_new_tokens(128, 100) == 10
    assert SamplingParams(temperature=0.0).is_greedy
    assert not SamplingParams(temperature=0.1).is_greedy


def test_values_that_vanish_in_float32_are_refused_where_they_arrive():
    """The HTTP body's doubles reach the workers as float32: a top_p or repetition penalty
    of 1e-300 would arrive as 0.0 and be refused there, by a worker."""
    from cleave.errors import InvalidArgument
    from cleave.generation.sampling_request import SamplingRequest, to_sampling_params

    for name in ("top_p", "repetition_penalty"):
        with pytest.raises(InvalidArgument) as raised:
            to_sampling_params(SamplingRequest(**{name: 1e-300}))
        assert raised.value.field == f"sampling.{name}"
        assert getattr(to_sampling_params(SamplingRequest(**{name: 1e-30})), name) == 1e-30
