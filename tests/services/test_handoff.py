"""Servicers hand typed requests to their backend and convert typed results back."""

from __future__ import annotations

import grpc
import pytest

from cleave.proto.cleave.v1 import common_pb2 as c, gateway_pb2 as g, gateway_pb2_grpc
from cleave.proto.cleave.v1 import kvstore_pb2 as k, kvstore_pb2_grpc
from cleave.rpc import aio_channel, serve
from cleave.rpc.types import FinishReason, SamplingParams, TensorBytes, Usage
from services.gateway.__main__ import registration as gateway_registration
from services.gateway.backend import GenerateChunk, SampleOutput
from services.gateway.servicer import GatewayServicer
from services.kvstore.__main__ import registration as kvstore_registration
from services.kvstore.backend import PutResult
from services.kvstore.servicer import KVStoreServicer
from tests.services.conftest import MODEL
from tests.services.doubles import UnwiredGatewayBackend, UnwiredKVStoreBackend


class EchoGatewayBackend(UnwiredGatewayBackend):
    """Records the spec and streams two chunks derived from it."""

    def __init__(self) -> None:
        self.specs = []

    async def generate(self, spec):
        self.specs.append(spec)
        yield GenerateChunk(samples=(SampleOutput(index=0, text="Hel", token_ids=(1, 2)),))
        yield GenerateChunk(
            samples=(SampleOutput(index=0, text="lo", finish_reason=FinishReason.STOP, answer="42"),),
            usage=Usage(prompt_tokens=3, completion_tokens=2),
        )


class CollectingKVStoreBackend(UnwiredKVStoreBackend):
    """Consumes the Put stream like a real store would."""

    def __init__(self) -> None:
        self.blocks = []

    async def put(self, blocks):
        async for block in blocks:
            self.blocks.append(block)
        return PutResult(num_stored=len(self.blocks), num_already_present=0)


@pytest.fixture
async def stubs():
    gateway_backend, kv_backend = EchoGatewayBackend(), CollectingKVStoreBackend()
    server = await serve(
        [gateway_registration(GatewayServicer(gateway_backend, [MODEL])),
         kvstore_registration(KVStoreServicer(kv_backend))],
        "127.0.0.1:0", handle_signals=False,
    )
    async with aio_channel(server.address) as channel:
        yield (gateway_pb2_grpc.GatewayStub(channel), gateway_backend,
               kvstore_pb2_grpc.KVStoreStub(channel), kv_backend)
    await server.drain(0)


async def test_generate_hands_a_typed_spec_and_streams_chunks(stubs):
    gateway, backend, _, _ = stubs
    request = g.GenerateRequest(text="hi", sampling=c.SamplingParams(temperature=0, max_tokens=8))
    call = gateway.Generate(request, metadata=(("x-request-id", "rid-9"),))
    responses = [r async for r in call]
    (spec,) = backend.specs
    assert spec.request_id == "rid-9" and spec.model == "tiny" and spec.prompt.text == "hi"
    assert spec.sampling == SamplingParams(temperature=0.0, max_tokens=8)
    assert [(r.request_id, r.model, r.samples[0].text) for r in responses] == [
        ("rid-9", "tiny", "Hel"), ("rid-9", "tiny", "lo")]
    assert list(responses[0].samples[0].token_ids) == [1, 2]
    assert not responses[0].HasField("usage") and responses[1].usage.prompt_tokens == 3
    last = responses[1].samples[0]
    assert last.finish_reason == c.FINISH_REASON_STOP and last.answer == "42"
    assert not last.HasField("reward")


async def test_client_request_id_wins_over_metadata(stubs):
    gateway, backend, _, _ = stubs
    responses = [r async for r in gateway.Generate(g.GenerateRequest(request_id="mine", text="x"))]
    assert backend.specs[0].request_id == "mine" and responses[0].request_id == "mine"


async def test_put_stream_blocks_are_validated_one_by_one(stubs):
    _, _, kvstore, backend = stubs
    good = k.KVBlock(hash=b"h0", layout_id="L", payload=c.Tensor(dtype=c.DTYPE_UINT8, shape=[2], data=b"ab"))
    assert (await kvstore.Put(iter([good]), timeout=5)).num_stored == 1
    assert backend.blocks[0].payload == TensorBytes("uint8", (2,), b"ab")
    bad = k.KVBlock(hash=b"h1", layout_id="L", payload=c.Tensor(dtype=c.DTYPE_FLOAT16, shape=[2], data=b"ab"))
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await kvstore.Put(iter([good, bad]), timeout=5)
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert raised.value.details().startswith("blocks[1].payload.data: holds 2 bytes")
