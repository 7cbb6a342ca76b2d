"""What the prefill servicer hands work to.

`PrefillBackend` receives a validated `PrefillSpec` (prompt ids, first-token sampling, and
where the KV goes: a decode worker to admit and start the request on, or a TransferHandle
someone else reserved) and returns a `PrefillResult`. With a decode worker to start, it
hands the first tokens to `early` as soon as they are sampled and the decode worker's blocks
are reserved, before the KV is on its way: the caller's client sees its first token without
waiting for the transfer. The engine-backed implementation is
`services.prefill.engine_backend.EnginePrefillBackend`.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
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
    # the caller's deadline (event-loop time): an Admit waiting for the decode worker's KV
    # blocks may wait until then (None: `decode_handoff.CONTROL_TIMEOUT_S`)
    deadline: float | None = None


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


# Receives a request's first tokens ahead of its KV transfer (`transfer` None).
EarlyFirstTokens = Callable[[PrefillResult], Awaitable[None]]


class PrefillBackend(Protocol):
    """A prefill worker's engine."""

    async def start(self) -> None:
        """Load the model and connect to the kvstore."""

    async def shutdown(self) -> None:
        """Finish or fail queued prefills and release the GPU."""

    async def drain(self) -> None:
        """Refuse new requests; return once the admitted ones finished (`cleave.rpc.Drainable`)."""

    async def prefill(self, spec: PrefillSpec, early: EarlyFirstTokens | None = None) -> PrefillResult:
        """Compute the prompt's KV, send it to its destination, sample the first tokens.
        With `spec.decode`, `early` (when given) gets the first tokens before the KV is sent;
        the decode starts only once the KV is there, and an error after `early` means it
        never started (its reservation released)."""

    def load(self) -> WorkerLoad:
        """Current load, for routing."""
