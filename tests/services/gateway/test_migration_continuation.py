"""continuation(): the restart of a moved sample asks the new worker for no prompt logprobs, and
for what is left of its minimum length."""

from __future__ import annotations

from cleave.generation.sampling_params import SamplingParams
from cleave.rpc.types import ReasoningOptions
from services.gateway.migration import continuation


def test_a_continuation_asks_for_no_prompt_logprobs():
    """The client already has the original prompt's scores, and the continuation's prompt
    holds the sample's output too, whose scores the worker must not return again."""
    params = SamplingParams(max_tokens=10, temperature=0.0, logprobs=1, prompt_logprobs=2)
    resumed = continuation([1, 2, 3], [7, 8], params, ReasoningOptions(), phase=None, num_reasoning_tokens=0,
                           reasoning=None, max_model_len=64)
    assert resumed is not None
    assert resumed.sampling.prompt_logprobs is None
    assert resumed.sampling.logprobs == 1  # output logprobs continue as requested
    assert params.prompt_logprobs == 2  # the request's own params are untouched


def test_a_continuation_asks_for_what_is_left_of_min_tokens():
    """The tokens already streamed count toward min_tokens: the new worker refused a minimum
    above the budget left to it, so such a sample could not move."""
    params = SamplingParams(max_tokens=20, min_tokens=10, temperature=0.0)
    for generated, left in ((4, 6), (15, 0)):
        resumed = continuation([1, 2, 3], [7] * generated, params, ReasoningOptions(), phase=None,
                               num_reasoning_tokens=0, reasoning=None, max_model_len=64)
        assert resumed is not None
        assert resumed.sampling.min_tokens == left
        resumed.sampling.validate(64, len(resumed.prompt_token_ids))
    assert params.min_tokens == 10
