"""Prefill and decode workers negotiate over gRPC on their first transfer: Handshake is
called once per pair, on CPU it picks TCP, and greedy tokens still equal the LLM's."""

from __future__ import annotations

import asyncio

from cleave.engine.llm import LLM
from cleave.generation.sampling_params import SamplingParams
from cleave.proto.cleave.v1 import common_pb2 as c
from cleave.proto.cleave.v1 import decode_pb2 as d
from cleave.proto.cleave.v1 import prefill_pb2 as p
from cleave.rpc.convert import transfer_handle_from_proto
from cleave.rpc.types import TransportKind
from cleave.rpc.prefill_call import prefill_response
from tests.worker.cluster import ENGINE_ARGS, GATEWAY, AttachReader, greedy, start_decode, start_prefill, wait_pool_full

MAX_TOKENS = 6
PROMPTS = [[11, 12, 13, 14, 15, 16, 17, 18, 19], [40, 41, 42, 43, 44, 45], [7, 300, 8, 301, 9, 302, 10, 303, 11, 304]]


async def test_first_transfer_handshakes_once_and_tokens_match_llm(checkpoint):
    decode, prefill = await start_decode(checkpoint), await start_prefill(checkpoint)
    decode.backend.set_control_address(decode.server.address)
    handshakes = []
    original = decode.backend.handshake

    async def counted(spec):
        handshakes.append(spec)
        return await original(spec)

    decode.backend.handshake = counted
    reader = AttachReader(decode.stub)
    try:
        handles, transports = [], []

        async def run(index: int, prompt: list[int]) -> None:
            request_id = f"r{index}"
            admitted = await decode.stub.Admit(d.AdmitRequest(
                request_id=request_id, prompt_token_ids=prompt, sampling=greedy(MAX_TOKENS), gateway_id=GATEWAY,
                prefill_worker_id="prefill-0"))
            handles.append(admitted.handle)
            prefilled = await prefill_response(prefill.stub.Prefill(p.PrefillRequest(
                request_id=request_id, prompt_token_ids=prompt, sampling=greedy(MAX_TOKENS),
                destination=admitted.handle)))
            transports.append(prefilled.transfer.transport)
            await decode.stub.Start(d.StartRequest(request_id=request_id, first_token_ids=prefilled.first_token_ids,
                                                   gateway_id=GATEWAY))

        await asyncio.gather(*(run(i, prompt) for i, prompt in enumerate(PROMPTS[:2])))  # concurrent first contact
        await run(2, PROMPTS[2])
        await reader.wait_finished(["r0", "r1", "r2"])

        assert [spec.peer_id for spec in handshakes] == ["prefill-0"]
        assert handshakes[0].gpu_uuids == () and TransportKind.TCP in handshakes[0].supported_transports
        assert {h.control_address for h in handles} == {decode.server.address}
        assert {h.transport for h in handles} == {c.TRANSPORT_KIND_TCP}
        assert transports == [c.TRANSPORT_KIND_TCP] * 3
        link = prefill.backend.negotiator.link(transfer_handle_from_proto(handles[0]))
        assert (link.transport, link.worker_id) == (TransportKind.TCP, "decode-0")

        reference = LLM(checkpoint, **ENGINE_ARGS).generate(
            PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True))
        assert [reader.tokens(f"r{i}") for i in range(3)] == [list(out.outputs[0].token_ids) for out in reference]
        await wait_pool_full(decode.stub)
    finally:
        await reader.cancel()
        await prefill.close()
        await decode.close()



def test_control_address_replaces_a_wildcard_host(checkpoint):
    from services.decode.engine_backend import EngineDecodeBackend
    from tests.worker.cluster import MODEL_ID, engine_config

    backend = EngineDecodeBackend(engine_config(checkpoint), worker_id="d", model_id=MODEL_ID, advertise_host="node-7")
    backend.set_control_address("0.0.0.0:50071")
    assert backend.control_address == "node-7:50071"
    backend.set_control_address("10.1.2.3:41")
    assert backend.control_address == "10.1.2.3:41"
