"""What the engine hands back per request: finish reasons, per-sample outputs, usage.

Streaming outputs are deltas: with `RequestOutput.delta` set, each `CompletionOutput`
holds only the text, token ids and logprobs produced since the previous `RequestOutput` of
the same request, while its counts (`num_tokens`, `num_reasoning_tokens`) and
`cumulative_logprob` are running totals. A 50k-token reasoning stream thus costs O(new
tokens) per message, not O(everything so far).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class FinishReason(str, enum.Enum):
    """Why a sample stopped (values match OpenAI's `finish_reason` strings where they exist)."""

    STOP = "stop"  # eos, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or the context window
    ABORT = "abort"  # cancelled by the client, a deadline or the server
    ERROR = "error"  # failed inside the engine
    TIMEOUT = "timeout"  # the request's deadline passed (set by services, not the engine)


@dataclass(slots=True)
class TokenLogprob:
    """Logprob of one generated token and its most likely alternatives (raw model logits).

    `rank` is the token's 1-based rank among the whole vocabulary, where it was computed (a
    prompt token's: vLLM returns it with prompt logprobs); 0: not ranked, known only when
    the token is among the alternatives.
    """

    token_id: int
    logprob: float
    top_token_ids: list[int] = field(default_factory=list)
    top_logprobs: list[float] = field(default_factory=list)
    rank: int = 0


@dataclass(slots=True)
class CompletionOutput:
    """One sample (index `index` of the request's `n`).

    Attributes:
        index: sample index in [0, n).
        text: answer text (reasoning removed when a reasoning parser runs).
        token_ids: generated token ids.
        reasoning_text: text of the thinking block, without its tags.
        finish_reason: None while the sample is still generating.
        stop_reason: the stop string or stop token id that ended it, if any.
        logprobs: one entry per token in `token_ids` when requested.
        cumulative_logprob: running sum of the sampled tokens' logprobs, when requested.
        num_tokens: running total of generated tokens.
        num_reasoning_tokens: running total of those spent thinking.
    """

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    reasoning_text: str = ""
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None
    logprobs: list[TokenLogprob] | None = None
    cumulative_logprob: float | None = None
    num_tokens: int = 0
    num_reasoning_tokens: int = 0

    @property
    def finished(self) -> bool:
        """True once a finish reason is set."""
        return self.finish_reason is not None


@dataclass(slots=True)
class Usage:
    """Token accounting of a request, summed over its samples."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    reasoning_tokens: int = 0
    cached_prompt_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        """Prompt plus completion tokens."""
        return self.prompt_tokens + self.completion_tokens


@dataclass(slots=True)
class RequestOutput:
    """The engine's report on one request after a step (or at the end).

    Attributes:
        request_id: the id the request was submitted with.
        prompt_token_ids: the prompt (may be empty on deltas after the first).
        outputs: one entry per sample that has news (all samples when not a delta).
        finished: True when every sample has finished.
        usage: running token counts.
        delta: whether `outputs` hold only what is new since the previous report.
        prompt_logprobs: with `SamplingParams.prompt_logprobs`, one entry per prompt token,
            the first None (nothing precedes it); a delta holds the entries new since the
            previous report. None when not asked.
    """

    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    usage: Usage = field(default_factory=Usage)
    delta: bool = True
    prompt_logprobs: list[TokenLogprob | None] | None = None
