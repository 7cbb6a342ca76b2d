"""What the gateway servicer hands work to, and the typed requests it hands over.

`GatewayBackend` is the seam between protobuf and the serving logic: the servicer validates a
GenerateRequest into a `GenerateSpec` and streams the backend's `GenerateChunk`s back. The
routing backend (tokenize, pick workers, Admit/Prefill/Start, fan out Attach streams) plugs
in here; until it does, `UnwiredGatewayBackend` answers UNIMPLEMENTED.
"""

from __future__ import annotations

import enum
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Protocol

from cleave.engine.outputs import FinishReason
from cleave.engine.sampling_params import SamplingParams
from cleave.rpc.types import ReasoningOptions, TopLogprobs, Usage


@dataclass(frozen=True)
class ChatMessage:
    """One chat turn."""

    role: str
    content: str
    reasoning_content: str = ""
    name: str = ""


@dataclass(frozen=True)
class Prompt:
    """Exactly one of text, token_ids or chat is set."""

    text: str | None = None
    token_ids: tuple[int, ...] | None = None
    chat: tuple[ChatMessage, ...] | None = None
    raw: bool = False  # text is the literal prompt: no chat template


class ScalingStrategy(enum.Enum):
    """How parallel samples are combined."""

    NONE = "none"
    MAJORITY_VOTE = "majority_vote"
    BEST_OF_N = "best_of_n"
    GROUP_ROLLOUT = "group_rollout"


class VerifierKind(enum.Enum):
    """What a verifier checks."""

    MATH = "math"
    CODE = "code"


@dataclass(frozen=True)
class CodeTest:
    """One stdin -> expected stdout case."""

    stdin: str
    expected_stdout: str


@dataclass(frozen=True)
class Verifier:
    """Scores a finished sample."""

    kind: VerifierKind
    expected_answer: str = ""
    tests: tuple[CodeTest, ...] = ()
    timeout_s: float | None = None


@dataclass(frozen=True)
class Scaling:
    """Test-time scaling of one request."""

    strategy: ScalingStrategy = ScalingStrategy.NONE
    num_samples: int = 1
    verifier: Verifier | None = None
    return_all_samples: bool = False


@dataclass(frozen=True)
class StreamShape:
    """How the response stream is shaped."""

    aggregate: bool = False
    include_token_ids: bool = False
    continuous_usage: bool = False


@dataclass(frozen=True)
class GenerateSpec:
    """A validated GenerateRequest (the request id is always set)."""

    request_id: str
    model: str
    prompt: Prompt
    sampling: SamplingParams  # validated, reasoning options applied
    reasoning: ReasoningOptions
    scaling: Scaling
    stream: StreamShape
    deadline: float | None = None  # event-loop time (loop.time()) by which the request must end


@dataclass(frozen=True)
class SampleOutput:
    """New output of one sample since the previous chunk."""

    index: int
    text: str = ""
    token_ids: tuple[int, ...] = ()
    reasoning_text: str = ""
    finish_reason: FinishReason | None = None  # None: still running
    logprobs: tuple[TopLogprobs, ...] = ()
    reward: float | None = None
    advantage: float | None = None
    answer: str | None = None


@dataclass(frozen=True)
class AnswerVotes:
    """Votes for one distinct answer."""

    answer: str
    num_votes: int
    sample_indices: tuple[int, ...]


@dataclass(frozen=True)
class GenerateChunk:
    """One message of the Generate stream."""

    samples: tuple[SampleOutput, ...] = ()
    usage: Usage | None = None
    selected_index: int | None = None
    votes: tuple[AnswerVotes, ...] = ()


class GatewayBackend(Protocol):
    """The gateway's serving logic."""

    async def start(self) -> None:
        """Connect to workers; the server reports SERVING after this returns."""

    async def shutdown(self) -> None:
        """Abort or finish running requests and close worker channels."""

    def generate(self, spec: GenerateSpec) -> AsyncIterator[GenerateChunk]:
        """Run a request; raise cleave.errors (NotFound, ResourceExhausted...) to fail it.
        Closing the iterator early (client gone, deadline) aborts the request on its worker."""

    async def abort(self, request_id: str, sample_index: int | None = None) -> bool:
        """Abort a running request (or only its sample `sample_index`: the stream goes on
        with the others); False if it is unknown or already finished."""


class UnwiredGatewayBackend:
    """A gateway with no routing logic yet: Generate and Abort answer UNIMPLEMENTED."""

    async def start(self) -> None:
        return None

    async def shutdown(self) -> None:
        return None

    def generate(self, spec: GenerateSpec) -> AsyncIterator[GenerateChunk]:
        raise NotImplementedError("Generate is not wired to prefill/decode workers yet")

    async def abort(self, request_id: str, sample_index: int | None = None) -> bool:
        raise NotImplementedError("Abort is not wired to decode workers yet")
