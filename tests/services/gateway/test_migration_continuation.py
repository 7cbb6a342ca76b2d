"""continuation(): the restart of a moved sample asks the new worker for no prompt logprobs."""

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
