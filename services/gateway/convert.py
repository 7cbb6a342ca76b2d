"""Gateway-only conversions: worker `RequestDelta` protobuf -> `TokenDelta`, and the
validation errors of the engine's `SamplingParams` renamed to request field paths.

Everything shared with the workers (sampling, reasoning, logprobs, finish reasons) uses
`cleave.rpc.convert`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from cleave.errors import InvalidArgument
from cleave.generation.outputs import FinishReason
from cleave.rpc.convert import finish_reason_from_proto, top_logprobs_from_proto
from cleave.rpc.types import TopLogprobs

# Engine validation fields that are not under `sampling.` in a GenerateRequest.
_REQUEST_FIELDS = {
    "prompt": "input",
    "max_thinking_tokens": "reasoning.max_thinking_tokens",
    "min_thinking_tokens": "reasoning.min_thinking_tokens",
}


@dataclass(frozen=True)
class TokenDelta:
    """One sample's new tokens from one decode step (a RequestDelta without protobuf)."""

    sample_index: int
    token_ids: tuple[int, ...]
    finish_reason: FinishReason | None = None
    logprobs: tuple[TopLogprobs, ...] = ()
    error_message: str = ""
    prompt_logprobs: tuple[TopLogprobs, ...] = ()  # the request's prompt tokens after the first


def token_delta_from_proto(delta: Any, sample_index: int | None = None) -> TokenDelta:
    """decode_pb2.RequestDelta -> TokenDelta (once per sample per step: the fields a delta
    leaves unset are not read), for `sample_index` when given (the request's own index of
    the worker's sample) else the delta's."""
    finish = delta.finish_reason
    return TokenDelta(
        delta.sample_index if sample_index is None else sample_index,
        tuple(delta.token_ids),
        finish_reason_from_proto(finish) if finish else None,
        top_logprobs_from_proto(delta.logprobs) if delta.logprobs else (),
        delta.error.message if finish and delta.HasField("error") else "",
        top_logprobs_from_proto(delta.prompt_logprobs) if delta.prompt_logprobs else (),
    )


def request_field(error: InvalidArgument) -> InvalidArgument:
    """The engine's validation error with its field as a GenerateRequest path."""
    field = error.field or ""
    if field.startswith(("sampling.", "reasoning.", "input")):
        return error
    path = _REQUEST_FIELDS.get(field, f"sampling.{field}" if field else "")
    return InvalidArgument(error.message, field=path or None)
