"""SamplingParams.validate at its limits: a value exactly at a bound is taken, one past it is
refused by name."""

from __future__ import annotations

import pytest

from cleave.errors import InvalidArgument
from cleave.generation.sampling_params import SamplingParams

# The documented limits, spelled out so that a changed constant fails here.
SEED_MIN = -(2**63)
SEED_MAX = 2**64 - 1
MAX_LOGPROBS = 20
MAX_LOGIT_BIAS_TOKENS = 1024
MAX_ABS_LOGIT_BIAS = 100.0
MAX_CACHE_SALT_CHARS = 256
MAX_STOP_TOKEN_IDS = 1024
VOCAB_SIZE = 2048


@pytest.mark.parametrize(
    "options",
    [
        dict(seed=SEED_MIN),
        dict(seed=SEED_MAX),
        dict(prompt_logprobs=0),
        dict(prompt_logprobs=MAX_LOGPROBS),
        dict(min_tokens=0),
        dict(min_tokens=16, max_tokens=16),
        dict(max_thinking_tokens=0),
        dict(logit_bias={i: MAX_ABS_LOGIT_BIAS for i in range(MAX_LOGIT_BIAS_TOKENS)}),
        dict(logit_bias={0: -MAX_ABS_LOGIT_BIAS, VOCAB_SIZE - 1: MAX_ABS_LOGIT_BIAS}),
        dict(cache_salt="s" * MAX_CACHE_SALT_CHARS),
        dict(stop_token_ids=list(range(MAX_STOP_TOKEN_IDS))),
    ],
)
def test_values_exactly_at_a_limit_are_taken(options):
    SamplingParams(**options).validate(vocab_size=VOCAB_SIZE)


@pytest.mark.parametrize(
    "options, field",
    [
        (dict(seed=SEED_MIN - 1), "seed"),
        (dict(seed=SEED_MAX + 1), "seed"),
        (dict(prompt_logprobs=-1), "prompt_logprobs"),
        (dict(prompt_logprobs=MAX_LOGPROBS + 1), "prompt_logprobs"),
        (dict(min_tokens=-1), "min_tokens"),
        (dict(min_tokens=17, max_tokens=16), "min_tokens"),
        (dict(logit_bias={i: 1.0 for i in range(MAX_LOGIT_BIAS_TOKENS + 1)}), "logit_bias"),
        (dict(logit_bias={VOCAB_SIZE: 1.0}), "logit_bias"),
        (dict(logit_bias={-1: 1.0}), "logit_bias"),
        (dict(logit_bias={7: MAX_ABS_LOGIT_BIAS + 0.5}), "logit_bias.7"),
        (dict(logit_bias={7: -MAX_ABS_LOGIT_BIAS - 0.5}), "logit_bias.7"),
        (dict(cache_salt="s" * (MAX_CACHE_SALT_CHARS + 1)), "cache_salt"),
        (dict(cache_salt=b"tenant"), "cache_salt"),
        (dict(cache_salt="\udc80"), "cache_salt"),
        (dict(stop_token_ids=[7] * (MAX_STOP_TOKEN_IDS + 1)), "stop_token_ids"),
    ],
)
def test_values_one_past_a_limit_are_refused_by_name(options, field):
    with pytest.raises(InvalidArgument) as info:
        SamplingParams(**options).validate(vocab_size=VOCAB_SIZE)
    assert info.value.field == field
    assert str(info.value).startswith(f"{field}: ")


def test_logit_bias_token_ids_are_unbounded_above_without_a_vocabulary():
    SamplingParams(logit_bias={10**9: 1.0}).validate()
