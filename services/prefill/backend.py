"""What the prefill servicer hands work to.

`PrefillBackend` receives a validated `PrefillSpec` (prompt ids, first-token sampling, and
where the KV goes: a decode worker to admit and start the request on, or a TransferHandle
someone else reserved) and returns a `PrefillResult`. The engine-backed
implementation is `services.prefill.engine_backend.EnginePrefillBackend`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from cleave.generation.sampling_params import SamplingParams
from cleave.rpc.types import ReasoningOptions, TopLogprobs, TransferHandle, TransferStats, WorkerLoad


@dataclass(frozen=True)
class DecodeTarget:
    """The decode worker a prefill worker admits the request on, fills and starts."""

    address: str  # host:port of its Decode service
    gateway_id: str  # whose Attach stream gets the tokens after the first
    reasoning: ReasoningOptions | None = None


@dataclass(frozen=True)
class PrefillSpec:
    """A validated PrefillRequest (at most one of `destination` and `decode`)."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams
    destination: TransferHandle | None  # blocks reserved by the caller; neither: the KV stays local
    store_to_kvstore: bool = False
    decode: DecodeTarget | None = None  # admit, fill and start the decode there


@dataclass(frozen=True)
class PrefillResult:
    """First tokens (one per sample) and accounting of one prefill."""

    first_token_ids: tuple[int, ...]
    num_prompt_tokens: int
    num_cached_tokens: int
    num_computed_tokens: int
    first_token_logprobs: tuple[TopLogprobs, ...] = ()
    transfer: TransferStats | None = None
    prompt_logprobs: tuple[TopLogprobs, ...] = ()  # with sampling.prompt_logprobs: prompt tokens after the first


class PrefillBackend(Protocol):
    """A prefill worker's engine."""

    async def start(self) -> None:
        """Load the model and connect to the kvstore."""

    async def shutdown(self) -> None:
        """Finish or fail queued prefills and release the GPU."""

    async def drain(self) -> None:
        """Refuse new requests; return once the admitted ones finished (`cleave.rpc.Drainable`)."""

    async def prefill(self, spec: PrefillSpec) -> PrefillResult:
        """Compute the prompt's KV, send it to spec.destination, sample the first tokens."""

    def load(self) -> WorkerLoad:
        """Current load, for routing."""
