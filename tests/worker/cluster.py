"""In-process prefill, decode and kvstore servers on ephemeral ports, as a gateway sees them:
each asks for the internal token (`INTERNAL_TOKEN`), which the stubs and the prefill worker send."""

from __future__ import annotations

import asyncio
import secrets
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from cleave.engine.llm import build_engine_config
from cleave.proto.cleave.v1 import common_pb2 as c
from cleave.proto.cleave.v1 import decode_pb2 as d
from cleave.proto.cleave.v1 import decode_pb2_grpc, kvstore_pb2_grpc, prefill_pb2_grpc
from cleave.rpc import aio_channel, serve
from cleave.rpc.auth import internal_auth
from services.decode.__main__ import registration as decode_registration
from services.decode.engine_backend import EngineDecodeBackend
from services.decode.servicer import DecodeServicer
from services.kvstore.__main__ import registration as kvstore_registration
from services.kvstore.servicer import KVStoreServicer
from services.kvstore.store import BlockStore, StoreConfig
from services.prefill.__main__ import registration as prefill_registration
from services.prefill.engine_backend import EnginePrefillBackend
from services.prefill.servicer import PrefillServicer

MODEL_ID = "tiny"
ENGINE_ARGS: dict[str, Any] = dict(device="cpu", dtype="float32", block_size=4, num_blocks=65, max_model_len=256)
GATEWAY = "gw-1"
INTERNAL_TOKEN = secrets.token_urlsafe(16)


def engine_config(path: Path, **overrides: Any):
    return build_engine_config(path, **{**ENGINE_ARGS, **overrides})


@dataclass
class Running:
    """One started server: its backend, a channel and a stub."""

    server: Any
    backend: Any
    channel: grpc.aio.Channel
    stub: Any

    async def close(self) -> None:
        await self.channel.close()
        await self.server.drain(0)
        await self.backend.shutdown()


async def _run(registration, backend, stub_class) -> Running:
    await backend.start()
    server = await serve([registration], "127.0.0.1:0", handle_signals=False, auth=internal_auth(INTERNAL_TOKEN))
    await server.set_ready()
    channel = aio_channel(server.address, internal_token=INTERNAL_TOKEN)
    return Running(server, backend, channel, stub_class(channel))


async def start_decode(path: Path, transfer_timeout_s: float = 10.0, max_queued_admissions: int = 256,
                       **overrides: Any) -> Running:
    backend = EngineDecodeBackend(engine_config(path, **overrides), worker_id="decode-0", model_id=MODEL_ID,
                                  transfer_timeout_s=transfer_timeout_s, internal_token=INTERNAL_TOKEN,
                                  max_queued_admissions=max_queued_admissions)
    return await _run(decode_registration(DecodeServicer(backend)), backend, decode_pb2_grpc.DecodeStub)


async def start_prefill(path: Path, kvstore: str | None = None, kvstore_min_prefix_tokens: int = 1,
                        **overrides: Any) -> Running:
    """A prefill worker; its kvstore use starts at one block (the tests' prompts are a few
    4-token blocks long)."""
    backend = EnginePrefillBackend(engine_config(path, **overrides), worker_id="prefill-0", model_id=MODEL_ID,
                                   kvstore_address=kvstore, internal_token=INTERNAL_TOKEN,
                                   kvstore_min_prefix_tokens=kvstore_min_prefix_tokens)
    return await _run(prefill_registration(PrefillServicer(backend, MODEL_ID)), backend, prefill_pb2_grpc.PrefillStub)


async def start_kvstore() -> Running:
    backend = BlockStore(StoreConfig(ram_bytes=64 * 1024 * 1024))
    return await _run(kvstore_registration(KVStoreServicer(backend)), backend, kvstore_pb2_grpc.KVStoreStub)


def greedy(max_tokens: int, **kwargs: Any) -> c.SamplingParams:
    return c.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kwargs)


class AttachReader:
    """Reads one gateway's Attach stream in the background, keeping every StepOutput."""

    def __init__(self, stub, gateway_id: str = GATEWAY) -> None:
        self.call = stub.Attach(d.AttachRequest(gateway_id=gateway_id))
        self.messages: list[d.StepOutput] = []
        self._changed = asyncio.Event()
        self.task = asyncio.ensure_future(self._read())

    async def _read(self) -> None:
        async for message in self.call:
            self.messages.append(message)
            self._changed.set()

    def deltas(self, request_id: str) -> list[d.RequestDelta]:
        return [delta for m in self.messages for delta in m.deltas if delta.request_id == request_id]

    def tokens(self, request_id: str, sample_index: int = 0) -> list[int]:
        return [t for delta in self.deltas(request_id) if delta.sample_index == sample_index for t in delta.token_ids]

    def finish(self, request_id: str, sample_index: int = 0) -> int:
        reasons = [x.finish_reason for x in self.deltas(request_id) if x.sample_index == sample_index and x.finish_reason]
        assert len(reasons) <= 1, f"{request_id} ended more than once: {reasons}"
        return reasons[0] if reasons else c.FINISH_REASON_UNSPECIFIED

    async def wait_finished(self, request_ids: list[str], num_samples: int = 1, timeout_s: float = 20.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not all(self.finish(r, i) for r in request_ids for i in range(num_samples)):
            assert time.monotonic() < deadline, "requests did not finish in time"
            self._changed.clear()
            try:
                await asyncio.wait_for(self._changed.wait(), max(0.0, deadline - time.monotonic()))
            except asyncio.TimeoutError:
                pass

    async def cancel(self) -> None:
        self.call.cancel()
        await asyncio.gather(self.task, return_exceptions=True)


async def wait_pool_full(stub, timeout_s: float = 5.0) -> c.WorkerLoad:
    """GetLoad until every KV block is free (releases are applied between engine steps)."""
    deadline = time.monotonic() + timeout_s
    while True:
        load = (await stub.GetLoad(c.GetLoadRequest())).load
        if load.num_free_blocks == load.num_total_blocks and load.num_running == 0 and load.num_waiting == 0:
            return load
        assert time.monotonic() < deadline, f"KV pool not back to full: {load}"
        await asyncio.sleep(0.02)


class BrokenBulkConnection:
    """Makes every bulk KV connection fail with ConnectionResetError after `num_chunks` chunk
    writes (counted in `writes`): a transfer torn mid-layer."""

    def __init__(self, monkeypatch, num_chunks: int) -> None:  # type: ignore[no-untyped-def]
        from cleave.transfer import connection

        self.writes = 0
        real_write = connection.BulkConnection.write_chunk

        async def write_then_break(bulk, header, payload=None):  # type: ignore[no-untyped-def]
            self.writes += 1
            if self.writes > num_chunks:
                raise ConnectionResetError("injected: connection reset mid-transfer")
            await real_write(bulk, header, payload)

        monkeypatch.setattr(connection.BulkConnection, "write_chunk", write_then_break)


async def check_torn_transfer(error: grpc.aio.AioRpcError, decode: Running, prefill: Running,
                              reader: AttachReader, request_id: str) -> None:
    """A prefill whose KV transfer broke: UNAVAILABLE naming the decode worker, both pools
    back to full, nothing streamed for the request."""
    from cleave.rpc.errors import error_detail

    assert error.code() == grpc.StatusCode.UNAVAILABLE, error.details()
    assert error_detail(error).field == "decode"
    assert "mid-transfer" in error.details()
    await wait_pool_full(decode.stub, timeout_s=10)
    await wait_pool_full(prefill.stub, timeout_s=10)
    assert reader.tokens(request_id) == []
