"""Backends that answer UNIMPLEMENTED, for exercising the servicers without an engine.

Each one satisfies its service's backend Protocol (`services.<name>.backend`): lifecycle
calls succeed, `load`/`stats` report an idle worker, and every RPC raises
NotImplementedError, which the rpc layer maps to UNIMPLEMENTED. Tests subclass them to
override only the calls they exercise.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from cleave.rpc.types import KVLayout, StepOutput, TransferHandle, WorkerLoad
from services.decode.backend import AdmitSpec, HandshakeResult, HandshakeSpec, StartSpec
from services.gateway.backend import GenerateChunk, GenerateSpec
from services.kvstore.backend import BlockEvent, ConnectResult, KVBlock, PutResult, StoreStats
from services.prefill.backend import EarlyFirstTokens, PrefillResult, PrefillSpec


class UnwiredGatewayBackend:
    """A gateway with no routing logic: Generate and Abort answer UNIMPLEMENTED."""

    async def start(self) -> None:
        return None

    async def shutdown(self) -> None:
        return None

    def generate(self, spec: GenerateSpec) -> AsyncIterator[GenerateChunk]:
        raise NotImplementedError("Generate is not wired to prefill/decode workers yet")

    async def abort(self, request_id: str, sample_index: int | None = None) -> bool:
        raise NotImplementedError("Abort is not wired to decode workers yet")


class UnwiredPrefillBackend:
    """A prefill worker with no engine: Prefill answers UNIMPLEMENTED, load is idle."""

    def __init__(self, worker_id: str) -> None:
        self.worker_id = worker_id

    async def start(self) -> None:
        return None

    async def shutdown(self) -> None:
        return None

    async def drain(self) -> None:
        return None

    async def prefill(self, spec: PrefillSpec, early: EarlyFirstTokens | None = None) -> PrefillResult:
        raise NotImplementedError("Prefill is not wired to an engine yet")

    def load(self) -> WorkerLoad:
        return WorkerLoad(worker_id=self.worker_id)


class UnwiredDecodeBackend:
    """A decode worker with no engine: its RPCs answer UNIMPLEMENTED, load is idle."""

    def __init__(self, worker_id: str) -> None:
        self.worker_id = worker_id

    async def start(self) -> None:
        return None

    async def shutdown(self) -> None:
        return None

    async def drain(self) -> None:
        return None

    async def admit(self, spec: AdmitSpec) -> TransferHandle:
        raise NotImplementedError("Admit is not wired to a KV cache yet")

    async def start_request(self, spec: StartSpec) -> int:
        raise NotImplementedError("Start is not wired to an engine yet")

    def attach(self, gateway_id: str) -> AsyncIterator[StepOutput]:
        raise NotImplementedError("Attach is not wired to an engine yet")

    async def abort(self, request_id: str, sample_index: int | None = None) -> bool:
        raise NotImplementedError("Abort is not wired to an engine yet")

    def load(self) -> WorkerLoad:
        return WorkerLoad(worker_id=self.worker_id)

    async def handshake(self, spec: HandshakeSpec) -> HandshakeResult:
        raise NotImplementedError("Handshake is not wired to a KV transport yet")


class UnwiredKVStoreBackend:
    """A store with no storage: its RPCs answer UNIMPLEMENTED, stats are empty."""

    async def start(self) -> None:
        return None

    async def shutdown(self) -> None:
        return None

    async def connect(self, layout: KVLayout, client_id: str) -> ConnectResult:
        raise NotImplementedError("Connect is not wired to a block store yet")

    async def lookup(self, layout_id: str, block_hashes: tuple[bytes, ...]) -> int:
        raise NotImplementedError("Lookup is not wired to a block store yet")

    async def put(self, blocks: AsyncIterator[KVBlock]) -> PutResult:
        raise NotImplementedError("Put is not wired to a block store yet")

    def get(self, layout_id: str, block_hashes: tuple[bytes, ...]) -> AsyncIterator[KVBlock]:
        raise NotImplementedError("Get is not wired to a block store yet")

    def stats(self) -> StoreStats:
        return StoreStats()

    def watch(self, layout_id: str) -> AsyncIterator[BlockEvent]:
        raise NotImplementedError("Watch is not wired to a block store yet")
