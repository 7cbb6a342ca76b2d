"""What the decode servicer hands work to.

Per request: `admit` reserves KV blocks and returns a TransferHandle, a prefill worker fills
them, `start` begins decoding (or prefills locally in colocated mode). Each gateway holds one
`attach` stream that yields a `StepOutput` per engine step with the new tokens of all its
requests. `services.decode.engine_backend.EngineDecodeBackend` implements it over the engine.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Protocol

from cleave.generation.sampling_params import SamplingParams
from cleave.rpc.types import (
    KVLayout,
    ReasoningOptions,
    StepOutput,
    TopLogprobs,
    TransferHandle,
    TransportKind,
    WorkerLoad,
)


@dataclass(frozen=True)
class AdmitSpec:
    """A validated AdmitRequest."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams
    gateway_id: str
    prefill_worker_id: str = ""


@dataclass(frozen=True)
class StartSpec:
    """A validated StartRequest.

    Disaggregated: first_token_ids holds one token per sample, the prompt KV is already in
    the admitted blocks. Colocated (prefill_locally): prompt_token_ids and sampling are set and
    the worker prefills itself.
    """

    request_id: str
    gateway_id: str
    first_token_ids: tuple[int, ...] = ()
    first_token_logprobs: tuple[TopLogprobs, ...] = ()
    prefill_locally: bool = False
    prompt_token_ids: tuple[int, ...] = ()
    sampling: SamplingParams | None = None  # None: the params given to admit
    reasoning: ReasoningOptions | None = None
    first_tokens_delivered: bool = False  # the client has them: stream only the later tokens


@dataclass(frozen=True)
class HandshakeSpec:
    """A prefill worker's transport proposal."""

    peer_id: str
    supported_transports: tuple[TransportKind, ...]
    host: str = ""
    gpu_uuids: tuple[str, ...] = ()
    nccl_unique_id: bytes = b""
    layout: KVLayout | None = None


@dataclass(frozen=True)
class HandshakeResult:
    """The transport both ends will use."""

    transport: TransportKind
    worker_id: str
    layout: KVLayout | None = None
    rank: int = 1
    world_size: int = 2
    tcp_address: str = ""


class DecodeBackend(Protocol):
    """A decode worker's engine."""

    async def start(self) -> None:
        """Load the model, allocate the KV cache, capture graphs."""

    async def shutdown(self) -> None:
        """Finish or abort running requests and release the GPU."""

    async def drain(self) -> None:
        """Refuse new requests; return once the admitted ones finished (`cleave.rpc.Drainable`)."""

    async def admit(self, spec: AdmitSpec) -> TransferHandle:
        """Reserve blocks for the prompt; raise ResourceExhausted when they do not fit."""

    async def start_request(self, spec: StartSpec) -> int:
        """Begin decoding; returns the number of prompt tokens found in the prefix cache."""

    def attach(self, gateway_id: str) -> AsyncIterator[StepOutput]:
        """The step stream of one gateway; ends when the worker drains."""

    async def abort(self, request_id: str, sample_index: int | None = None) -> bool:
        """Abort a request (or only its sample `sample_index`) and free its blocks; False
        if unknown or finished."""

    def load(self) -> WorkerLoad:
        """Current load, for routing."""

    async def handshake(self, spec: HandshakeSpec) -> HandshakeResult:
        """Pick a transport with a prefill worker (and join its NCCL communicator)."""
