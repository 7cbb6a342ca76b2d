"""`SamplingRequest`: a client's sampling options as sent, and the one validator that turns
them into the engine's `SamplingParams`.

Both public APIs end here: the gRPC servicers read a `cleave.v1.SamplingParams` message into
a SamplingRequest (`cleave.rpc.convert.sampling_from_proto`), the OpenAI HTTP API reads the
JSON body into one (`services.gateway.openai_request`), and `to_sampling_params` checks the
values and fills the defaults the same way for both, so the two accept and reject the same
requests. Errors raise InvalidArgument naming `<field>.<option>` (e.g. "sampling.top_p";
the HTTP API reports the option's OpenAI name).
"""

from __future__ import annotations

import ctypes
import math
from dataclasses import dataclass

from cleave.errors import InvalidArgument
from cleave.generation.sampling_params import MAX_LOGPROBS, MAX_STOP_TOKEN_IDS, SamplingParams
from cleave.generation.structured_output import StructuredOutput

MAX_SAMPLES = 1024  # samples of one request
MAX_TOKEN_ID = 2**31 - 1  # token ids must fit the engine's int32
_MAX_FLOAT32 = 3.4028234663852886e38


@dataclass(frozen=True)
class SamplingRequest:
    """Sampling options as a client sent them; None (or the zero value where the API has
    no "unset") takes the engine's default. Types are checked by the reader of each API;
    ranges by `to_sampling_params`."""

    max_tokens: int | None = None  # None: the context left after the prompt
    min_tokens: int = 0
    temperature: float | None = None  # None: 1.0
    top_p: float | None = None  # None: 1.0
    top_k: int = 0  # 0: off
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    n: int | None = None  # None: 1
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    repetition_penalty: float | None = None  # None: 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    ignore_eos: bool = False
    skip_special_tokens: bool | None = None  # None: True
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias) pairs
    structured_output: StructuredOutput | None = None
    cache_salt: str = ""  # "": the shared prefix cache
    priority: int = 0  # lower first


def _wire(value: float) -> float:
    """`value` as the workers receive it: a float32 on the wire (1e-300 arrives as 0.0)."""
    return ctypes.c_float(value).value


def _check_finite(value: float, field: str) -> None:
    """`value` is finite, and stays finite as the float32 the workers receive (1e300 would
    arrive as inf)."""
    if not math.isfinite(value):
        raise InvalidArgument(f"must be a finite number, got {value}", field=field)
    if not math.isfinite(_wire(value)):
        raise InvalidArgument(f"must fit a 32-bit float (magnitude at most {_MAX_FLOAT32:.4g}), got {value:g}",
                              field=field)


def to_sampling_params(
    request: SamplingRequest,
    field: str = "sampling",
    *,
    max_thinking_tokens: int | None = None,
    min_thinking_tokens: int = 0,
    include_reasoning: bool = True,
) -> SamplingParams:
    """The validated engine parameters of `request` (thinking budgets and whether reasoning
    text is returned come from the request's reasoning options)."""
    temperature = request.temperature
    if temperature is not None:
        _check_finite(temperature, f"{field}.temperature")
        if temperature < 0:
            raise InvalidArgument("must be >= 0 (0 is greedy)", field=f"{field}.temperature")
    top_p = request.top_p
    if top_p is not None and not (0.0 < _wire(top_p) <= 1.0):
        raise InvalidArgument(f"must be in (0, 1], got {top_p}", field=f"{field}.top_p")
    if not (0.0 <= request.min_p <= 1.0):
        raise InvalidArgument(f"must be in [0, 1], got {request.min_p}", field=f"{field}.min_p")
    n = request.n or 1
    if n > MAX_SAMPLES:
        raise InvalidArgument(f"at most {MAX_SAMPLES} samples per request", field=f"{field}.n")
    for name in ("logprobs", "prompt_logprobs"):
        value = getattr(request, name)
        if value is not None and value > MAX_LOGPROBS:
            raise InvalidArgument(f"at most {MAX_LOGPROBS} top logprobs", field=f"{field}.{name}")
    repetition_penalty = request.repetition_penalty
    if repetition_penalty is not None:
        _check_finite(repetition_penalty, f"{field}.repetition_penalty")
        if _wire(repetition_penalty) <= 0:
            raise InvalidArgument("must be > 0 (1 = none)", field=f"{field}.repetition_penalty")
    for name in ("frequency_penalty", "presence_penalty"):
        value = getattr(request, name)
        _check_finite(value, f"{field}.{name}")
        if not (-2.0 <= value <= 2.0):
            raise InvalidArgument(f"must be in [-2, 2], got {value}", field=f"{field}.{name}")
    if request.max_tokens and request.min_tokens > request.max_tokens:
        raise InvalidArgument("must not exceed max_tokens", field=f"{field}.min_tokens")
    for position, stop in enumerate(request.stop):
        if not stop:
            raise InvalidArgument("stop strings must not be empty", field=f"{field}.stop[{position}]")
    if len(request.stop_token_ids) > MAX_STOP_TOKEN_IDS:  # before the loop over them
        raise InvalidArgument(f"holds {len(request.stop_token_ids)} token ids; at most {MAX_STOP_TOKEN_IDS}",
                              field=f"{field}.stop_token_ids")
    for position, token_id in enumerate(request.stop_token_ids):
        if not 0 <= token_id <= MAX_TOKEN_ID:
            raise InvalidArgument(f"token id {token_id} is out of range", field=f"{field}.stop_token_ids[{position}]")
    params = SamplingParams(
        max_tokens=request.max_tokens or None,
        temperature=1.0 if temperature is None else temperature,
        top_p=1.0 if top_p is None else top_p,
        top_k=request.top_k,
        min_p=request.min_p,
        seed=request.seed,
        stop=list(request.stop),
        stop_token_ids=list(request.stop_token_ids),
        n=n,
        logprobs=request.logprobs,
        prompt_logprobs=request.prompt_logprobs,
        repetition_penalty=1.0 if repetition_penalty is None else repetition_penalty,
        frequency_penalty=request.frequency_penalty,
        presence_penalty=request.presence_penalty,
        ignore_eos=request.ignore_eos,
        skip_special_tokens=request.skip_special_tokens is not False,
        max_thinking_tokens=max_thinking_tokens,
        min_thinking_tokens=min_thinking_tokens,
        include_reasoning=include_reasoning,
        min_tokens=request.min_tokens,
        logit_bias=dict(request.logit_bias) or None,
        structured_output=request.structured_output,
        cache_salt=request.cache_salt,
        priority=request.priority,
    )
    try:
        params.validate()
    except InvalidArgument as error:
        raise InvalidArgument(error.message, field=f"{field}.{error.field}") from None
    return params
