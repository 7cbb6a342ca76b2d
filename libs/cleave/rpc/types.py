"""Typed domain objects that cross service boundaries, independent of protobuf.

Servicers convert protobuf messages into these (`cleave.rpc.convert`) and hand them to a
service backend; backends never see protobuf. Token ids are plain ints; tensors are raw
bytes with a torch dtype name and a shape. Sampling parameters and finish reasons are the
engine's own types (`cleave.generation.sampling_params.SamplingParams`,
`cleave.generation.outputs.FinishReason`), re-exported here for convenience.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field

from cleave.generation.outputs import FinishReason
from cleave.generation.sampling_params import SamplingParams

__all__ = [
    "ErrorInfo", "FinishReason", "KVLayout", "ReasoningMode", "ReasoningOptions", "RequestDelta",
    "SamplingParams", "StepOutput", "TensorBytes", "TokenLogprob", "TopLogprobs", "TransferHandle",
    "TransferStats", "TransportKind", "Usage", "WorkerLoad",
]


class ReasoningMode(enum.Enum):
    """Where a reasoning model's thinking text goes."""

    DEFAULT = "default"  # SEPARATE for reasoning models, INLINE otherwise
    SEPARATE = "separate"
    HIDDEN = "hidden"
    INLINE = "inline"


class TransportKind(enum.Enum):
    """Bulk KV transport."""

    TCP = "tcp"
    CUDA_IPC = "cuda_ipc"
    NCCL = "nccl"


REASONING_EFFORTS = ("low", "medium", "high")  # OpenAI's `reasoning_effort`, as gpt-oss reads it


@dataclass(frozen=True)
class ReasoningOptions:
    """Thinking controls of one request."""

    mode: ReasoningMode = ReasoningMode.DEFAULT
    max_thinking_tokens: int | None = None
    min_thinking_tokens: int | None = None
    enable_thinking: bool | None = None
    reasoning_effort: str | None = None  # one of REASONING_EFFORTS, for the chat template

    def template_kwargs(self) -> dict[str, object]:
        """The chat template's variables these options set (unset ones keep its defaults)."""
        values = {"enable_thinking": self.enable_thinking, "reasoning_effort": self.reasoning_effort}
        return {name: value for name, value in values.items() if value is not None}


@dataclass(frozen=True)
class TokenLogprob:
    """Log-probability of one token, as it crosses a service boundary.

    Not `cleave.generation.outputs.TokenLogprob`: the engine's holds a sampled token with
    parallel lists of alternative ids and logprobs, as the sampler produces them; this one
    is a single token with its text and rank, and `TopLogprobs` groups one position's
    sampled token with its alternatives, as the wire and the OpenAI API present them.
    """

    token_id: int
    logprob: float
    text: str = ""
    rank: int = 0


@dataclass(frozen=True)
class TopLogprobs:
    """The sampled token's log-probability and the top alternatives at one position."""

    sampled: TokenLogprob
    top: tuple[TokenLogprob, ...] = ()


@dataclass(frozen=True)
class Usage:
    """Token accounting of one request, as it crosses a service boundary.

    The fields of `cleave.generation.outputs.Usage`, but frozen: the engine's is a running
    counter it mutates every step, while this is a snapshot that streams and responses may
    share without copying.
    """

    prompt_tokens: int = 0
    completion_tokens: int = 0
    reasoning_tokens: int = 0
    cached_prompt_tokens: int = 0


@dataclass(frozen=True)
class ErrorInfo:
    """A per-sample failure carried inside a stream (the RPC itself succeeds)."""

    code: str  # grpc.StatusCode name, e.g. "RESOURCE_EXHAUSTED"
    message: str
    field: str = ""


@dataclass(frozen=True)
class TensorBytes:
    """A dense tensor as raw little-endian row-major bytes.

    `dtype` is a torch dtype name ("bfloat16"), so `getattr(torch, dtype)` gives the dtype.
    """

    dtype: str
    shape: tuple[int, ...]
    data: bytes


@dataclass(frozen=True)
class KVLayout:
    """Shape of a model's paged KV cache; KV moves only between equal layouts, except that
    a sender holding a range of the model's KV heads that contains the receiver's sends
    it that slice (`cleave.transfer.layout.head_slice`)."""

    model_id: str
    dtype: str  # torch dtype name
    block_size: int
    num_layers: int
    num_kv_heads: int  # heads this cache holds
    head_dim: int
    hash_namespace: str = ""
    kv_head_start: int = 0  # first of the model's heads this cache holds
    total_kv_heads: int = 0  # the model's heads; 0: num_kv_heads (not sharded)

    @property
    def heads(self) -> range:
        """The model's KV heads this cache holds."""
        return range(self.kv_head_start, self.kv_head_start + self.num_kv_heads)

    @property
    def model_kv_heads(self) -> int:
        """The model's KV heads per layer."""
        return self.total_kv_heads or self.num_kv_heads


@dataclass(frozen=True)
class TransferHandle:
    """KV blocks a decode worker reserved for a prompt, and how to fill them."""

    transport: TransportKind
    address: str
    transfer_id: str
    block_ids: tuple[int, ...]
    layout: KVLayout | None = None
    nccl_unique_id: bytes = b""
    cuda_ipc_handle: bytes = b""
    device_index: int | None = None
    deadline_unix_s: float | None = None  # the reservation is dropped after this time
    num_cached_blocks: int = 0  # leading blocks the receiver already holds
    worker_id: str = ""
    control_address: str = ""  # the receiver's gRPC endpoint, where senders call Handshake
    # A tensor-parallel receiver's ranks 1..N-1, each with its heads' layout, its bulk
    # endpoint and its own block ids (always TCP); the transfer is done when every rank's is.
    rank_handles: tuple[TransferHandle, ...] = ()


@dataclass(frozen=True)
class TransferStats:
    """What one KV transfer moved and how long it took."""

    transport: TransportKind
    num_bytes: int
    seconds: float
    num_blocks: int

    @classmethod
    def of_parts(cls, parts: Sequence[TransferStats]) -> TransferStats:
        """One transfer moved as parts at once (a tensor-parallel worker's ranks, each its
        heads of the same blocks): bytes summed, the slowest part's time."""
        first = parts[0]
        return cls(transport=first.transport, num_bytes=sum(part.num_bytes for part in parts),
                   seconds=max(part.seconds for part in parts), num_blocks=first.num_blocks)


@dataclass(frozen=True)
class WorkerLoad:
    """A worker's load, for routing."""

    worker_id: str = ""
    num_running: int = 0
    num_waiting: int = 0
    num_free_blocks: int = 0
    num_total_blocks: int = 0
    num_queued_prompt_tokens: int = 0
    max_num_running: int = 0
    tokens_per_second: float = 0.0
    num_attached_gateways: int = 0  # decode: gateways with an open Attach stream


@dataclass(frozen=True)
class RequestDelta:
    """One sample's new tokens in one engine step."""

    request_id: str
    sample_index: int
    token_ids: tuple[int, ...]
    finish_reason: FinishReason | None = None
    logprobs: tuple[TopLogprobs, ...] = ()
    error: ErrorInfo | None = None
    num_reasoning_tokens: int = 0
    prompt_logprobs: tuple[TopLogprobs, ...] = ()  # prompt tokens after the first (once per request)


@dataclass(frozen=True)
class StepOutput:
    """One engine step's deltas for one gateway."""

    step: int
    deltas: tuple[RequestDelta, ...] = field(default_factory=tuple)
    load: WorkerLoad | None = None
