"""The OpenAI HTTP API and the gRPC API share one sampling validator: the same option values
give the same engine SamplingParams, or are refused naming the same option."""

from __future__ import annotations

import pytest

from cleave.errors import InvalidArgument
from cleave.proto.cleave.v1 import common_pb2
from cleave.rpc.convert import sampling_from_proto
from cleave.rpc.types import ReasoningMode, ReasoningOptions
from services.gateway.openai_request import generate_spec

CASES = [
    {"max_tokens": 7},
    {"temperature": 0.0, "top_p": 0.5, "top_k": 3, "min_p": 0.1, "seed": 11},
    {"frequency_penalty": 1.5, "presence_penalty": -0.5, "repetition_penalty": 1.2},
    {"stop": ["x", "yz"], "n": 3, "ignore_eos": True, "skip_special_tokens": False},
    {"temperature": -1.0},
    {"top_p": 0.0},
    {"top_p": 1.5},
    {"min_p": 2.0},
    {"repetition_penalty": 0.0},
    {"frequency_penalty": 3.0},
    {"stop": ["ok", ""]},
    {"logprobs": 21},
]


def http_sampling(options: dict):
    body = {"prompt": "hi", "reasoning_mode": "inline", **options}
    if "stop" in options:
        body["stop"] = list(options["stop"])
    spec, _ = generate_spec(body, "r", "m", chat=False)
    return spec.sampling


def grpc_sampling(options: dict):
    message = common_pb2.SamplingParams(**{key: value for key, value in options.items()})
    return sampling_from_proto(message, reasoning=ReasoningOptions(mode=ReasoningMode.INLINE))


def outcome(build, options):
    try:
        return "ok", build(options)
    except InvalidArgument as error:
        return "refused", error.field.removeprefix("sampling.")


@pytest.mark.parametrize("options", CASES, ids=[",".join(f"{k}={v}" for k, v in case.items()) for case in CASES])
def test_both_apis_give_the_same_params_or_refuse_the_same_option(options):
    http, grpc_ = outcome(http_sampling, options), outcome(grpc_sampling, options)
    assert http[0] == grpc_[0], (http, grpc_)
    if http[0] == "refused":
        assert http[1] == grpc_[1]
    else:
        assert_same_params(http[1], grpc_[1])


def assert_same_params(http, grpc_) -> None:
    """Field by field; floats within float32 rounding (the gRPC wire type)."""
    for name, value in vars(http).items():
        other = getattr(grpc_, name)
        if isinstance(value, float):
            assert other == pytest.approx(value, rel=1e-6), name
        else:
            assert other == value, name
