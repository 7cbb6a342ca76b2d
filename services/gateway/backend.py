"""What the gateway servicer hands work to, and the typed requests it hands over.

`GatewayBackend` is the seam between protobuf and the serving logic: the servicer validates a
GenerateRequest into a `GenerateSpec` and streams the backend's `GenerateChunk`s back. The
implementation is `services.gateway.router.RoutingBackend` (tokenize, pick workers,
Admit/Prefill/Start, fan out Attach streams), wrapped in `services.gateway.metered.MeteredBackend`.
"""

from __future__ import annotations

import enum
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Protocol

from cleave.generation.outputs import FinishReason
from cleave.generation.sampling_params import SamplingParams
from cleave.generation.tool_calls import ForcedCall, ToolCall
from cleave.rpc.types import ReasoningOptions, TopLogprobs, Usage
from cleave.scaling.code_verifier import CodeTest, check_tests
from cleave.scaling.math_verifier import check_expected_answer
from cleave.scaling.strategies import AnswerVotes, Strategy
from services.gateway.prompt_truncation import PromptTruncation


@dataclass(frozen=True)
class ChatMessage:
    """One chat turn; an assistant turn may hold the tool calls it made (as the chat template
    reads them: {"id", "type", "function": {"name", "arguments": object}}), a tool turn the id
    of the call it answers."""

    role: str
    content: str
    reasoning_content: str = ""
    name: str = ""
    tool_calls: tuple[dict[str, Any], ...] = ()
    tool_call_id: str = ""


@dataclass(frozen=True)
class Prompt:
    """Exactly one of text, token_ids or chat is set.

    The gateway's alone: it tokenizes (`services.gateway.model.ServedModel`), so workers and
    the engine only ever see token ids.
    """

    text: str | None = None
    token_ids: tuple[int, ...] | None = None
    chat: tuple[ChatMessage, ...] | None = None
    raw: bool = False  # text is the literal prompt: no chat template
    # tools the chat template describes to the model (OpenAI's {"type": "function", "function": ...})
    tools: tuple[dict[str, Any], ...] = ()


class VerifierKind(enum.Enum):
    """What a verifier checks."""

    MATH = "math"
    CODE = "code"


@dataclass(frozen=True)
class VerifierSpec:
    """Which verifier a request asks for, and its inputs.

    A request-side description, not the scorer itself: `services.gateway.scaling` builds the
    `cleave.scaling.Verifier` (a MathVerifier or CodeVerifier with a `score(text)` method)
    from it once the samples are in. The code tests are `cleave.scaling.CodeTest`s as they are.
    """

    kind: VerifierKind
    expected_answer: str = ""
    tests: tuple[CodeTest, ...] = ()
    timeout_s: float | None = None

    def __post_init__(self) -> None:
        """Refuse inputs past the verifiers' bounds when the request is read, before any
        sample is drawn (InvalidArgument naming the GenerateRequest's field)."""
        check_expected_answer(self.expected_answer, "scaling.verifier.expected_answer")
        check_tests(self.tests, "scaling.verifier.tests")


@dataclass(frozen=True)
class Scaling:
    """Test-time scaling of one request."""

    strategy: Strategy = Strategy.NONE
    num_samples: int = 1
    verifier: VerifierSpec | None = None
    return_all_samples: bool = False


@dataclass(frozen=True)
class StreamShape:
    """How the response stream is shaped."""

    aggregate: bool = False
    include_token_ids: bool = False
    continuous_usage: bool = False
    include_prompt_token_ids: bool = False  # the first chunk carries the prompt's token ids


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
    parse_tool_calls: bool = False  # answers' tool calls come apart from their content
    parallel_tool_calls: bool = True  # False: an answer's first call only
    forced_call: ForcedCall | None = None  # tool_choice forced calls: the answer is their JSON
    tenant: str = ""  # with several API keys, the tag of the key it came with (`services.gateway.tenants`)
    include_stop_str: bool = False  # a stop string that ends a sample stays in its text (vLLM's option)
    truncation: PromptTruncation | None = None  # vLLM's truncate_prompt_tokens: the prompt's last tokens alone run
    batch_size: int = 1  # requests its body runs at once, itself included (a completions body's list of prompts)


def num_samples(spec: GenerateSpec) -> int:
    """Samples `spec` runs on the workers: `scaling.num_samples` under a scaling strategy,
    else `sampling.n`."""
    return spec.scaling.num_samples if spec.scaling.strategy is not Strategy.NONE else spec.sampling.n


def num_samples_field(spec: GenerateSpec) -> str:
    """The GenerateRequest field `num_samples(spec)` comes from (an error about it names this)."""
    return "scaling.num_samples" if spec.scaling.strategy is not Strategy.NONE else "sampling.n"


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
    tool_calls: tuple[ToolCall, ...] = ()  # calls completed since the previous chunk


@dataclass(frozen=True)
class GenerateChunk:
    """One message of the Generate stream."""

    samples: tuple[SampleOutput, ...] = ()
    usage: Usage | None = None
    selected_index: int | None = None
    votes: tuple[AnswerVotes, ...] = ()
    # with sampling.prompt_logprobs, on one chunk: scores of the prompt tokens after the first,
    # and the prompt's token ids (with stream.include_prompt_token_ids, the ids on the first chunk too)
    prompt_logprobs: tuple[TopLogprobs, ...] = ()
    prompt_token_ids: tuple[int, ...] = ()


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


class BackendLayer:
    """A GatewayBackend around another (metering, limits, tenants, client-safe errors): start,
    shutdown, abort and generate go to `backend`; a layer overrides what it changes."""

    def __init__(self, backend: GatewayBackend) -> None:
        self.backend = backend

    async def start(self) -> None:
        await self.backend.start()

    async def shutdown(self) -> None:
        await self.backend.shutdown()

    def generate(self, spec: GenerateSpec) -> AsyncIterator[GenerateChunk]:
        return self.backend.generate(spec)

    async def abort(self, request_id: str, sample_index: int | None = None) -> bool:
        return await self.backend.abort(request_id, sample_index)
