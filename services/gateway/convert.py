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


def token_delta_from_proto(delta: Any) -> TokenDelta:
    """decode_pb2.RequestDelta -> TokenDelta."""
    return TokenDelta(
        sample_index=delta.sample_index,
        token_ids=tuple(delta.token_ids),
        finish_reason=finish_reason_from_proto(delta.finish_reason),
        logprobs=top_logprobs_from_proto(delta.logprobs),
        error_message=delta.error.message if delta.HasField("error") else "",
        prompt_logprobs=top_logprobs_from_proto(delta.prompt_logprobs),
    )


def request_field(error: InvalidArgument) -> InvalidArgument:
    """The engine's validation error with its field as a GenerateRequest path."""
    field = error.field or ""
    if field.startswith(("sampling.", "reasoning.", "input")):
        return error
    path = _REQUEST_FIELDS.get(field, f"sampling.{field}" if field else "")
    return InvalidArgument(error.message, field=path or None)
