"""Every RPC of every service answers a bad request with a precise status, never a crash."""

from __future__ import annotations

import grpc
import pytest
from google.protobuf.duration_pb2 import Duration
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from cleave.proto.cleave.v1 import (
    common_pb2 as c,
    decode_pb2 as d,
    decode_pb2_grpc,
    gateway_pb2 as g,
    gateway_pb2_grpc,
    kvstore_pb2 as k,
    kvstore_pb2_grpc,
    prefill_pb2 as p,
    prefill_pb2_grpc,
)
from tests.services.conftest import MODEL

INVALID, UNIMPLEMENTED, NOT_FOUND = (
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.UNIMPLEMENTED,
    grpc.StatusCode.NOT_FOUND,
)
STUBS = {
    "Gateway": gateway_pb2_grpc.GatewayStub,
    "Prefill": prefill_pb2_grpc.PrefillStub,
    "Decode": decode_pb2_grpc.DecodeStub,
    "KVStore": kvstore_pb2_grpc.KVStoreStub,
}
LAYOUT = c.KVLayout(model_id="tiny", dtype=c.DTYPE_BFLOAT16, block_size=16, num_layers=2,
                    num_kv_heads=4, head_dim=64)
TCP_HANDLE = c.TransferHandle(transport=c.TRANSPORT_KIND_TCP, address="127.0.0.1:9", transfer_id="t",
                              block_ids=[1, 2])
BLOCK = k.KVBlock(hash=b"h1", layout_id="L", payload=c.Tensor(dtype=c.DTYPE_UINT8, shape=[4], data=b"abcd"))

# (service, method, request, expected code, text the status message must contain)
CASES = [
    ("Gateway", "Generate", g.GenerateRequest(), INVALID, "input: set one of text, token_ids or chat"),
    ("Gateway", "Generate", g.GenerateRequest(text=""), INVALID, "text: must not be empty"),
    ("Gateway", "Generate", g.GenerateRequest(token_ids=g.TokenIds()), INVALID, "token_ids.ids: must contain"),
    ("Gateway", "Generate", g.GenerateRequest(text="hi", sampling=c.SamplingParams(top_p=2)), INVALID, "sampling.top_p"),
    ("Gateway", "Generate", g.GenerateRequest(text="hi", model="other"), NOT_FOUND, "model: model 'other' is not served here; served: tiny"),
    ("Gateway", "Generate", g.GenerateRequest(chat=g.ChatMessages(messages=[g.ChatMessage(role="robot")])), INVALID, "chat.messages[0].role"),
    ("Gateway", "Generate", g.GenerateRequest(token_ids=g.TokenIds(ids=[1]), raw_prompt=True), INVALID, "raw_prompt"),
    ("Gateway", "Generate", g.GenerateRequest(text="hi", reasoning=c.ReasoningOptions(max_thinking_tokens=1, min_thinking_tokens=2)), INVALID, "reasoning.min_thinking_tokens"),
    ("Gateway", "Generate", g.GenerateRequest(text="hi", scaling=g.TestTimeScaling(strategy=g.TestTimeScaling.STRATEGY_BEST_OF_N)), INVALID, "scaling.verifier: BEST_OF_N needs a verifier"),
    ("Gateway", "Generate", g.GenerateRequest(text="hi", scaling=g.TestTimeScaling(verifier=g.Verifier(kind=g.Verifier.KIND_CODE))), INVALID, "scaling.verifier.tests"),
    ("Gateway", "Generate", g.GenerateRequest(text="hi", scaling=g.TestTimeScaling(verifier=g.Verifier(kind=g.Verifier.KIND_CODE, tests=[g.CodeTest()] * 65))), INVALID, "scaling.verifier.tests: at most 64 tests, got 65"),
    ("Gateway", "Generate", g.GenerateRequest(text="hi", scaling=g.TestTimeScaling(verifier=g.Verifier(kind=g.Verifier.KIND_CODE, tests=[g.CodeTest()], timeout=Duration(seconds=10**9)))), INVALID, "scaling.verifier.timeout: must be positive and at most 30s per test"),
    # 30 MB were read, normalised and compared for every sample (1-2 s); an expected output past the sandbox's 1 MiB of stdout can never match
    ("Gateway", "Generate", g.GenerateRequest(text="hi", scaling=g.TestTimeScaling(verifier=g.Verifier(kind=g.Verifier.KIND_MATH, expected_answer="7" * (64 * 1024 + 1)))), INVALID, "scaling.verifier.expected_answer: at most 65536 characters, got 65537"),
    ("Gateway", "Generate", g.GenerateRequest(text="hi", scaling=g.TestTimeScaling(verifier=g.Verifier(kind=g.Verifier.KIND_CODE, tests=[g.CodeTest(stdin="1\n", expected_stdout="1"), g.CodeTest(stdin="x" * 2**19, expected_stdout="y" * (2**19 + 1))]))), INVALID, "scaling.verifier.tests[1]: stdin and expected_stdout hold at most 1048576 characters together, got 1048577"),
    ("Gateway", "Generate", g.GenerateRequest(text="hi", model="tiny"), UNIMPLEMENTED, "Generate is not wired"),
    ("Gateway", "Abort", c.AbortRequest(), INVALID, "request_id: must be set"),
    ("Prefill", "Prefill", p.PrefillRequest(), INVALID, "request_id: must be set"),
    ("Prefill", "Prefill", p.PrefillRequest(request_id="r"), INVALID, "prompt_token_ids: must contain"),
    ("Prefill", "Prefill", p.PrefillRequest(request_id="r", prompt_token_ids=[1], model="other"), INVALID, "model: this worker serves 'tiny'"),
    ("Prefill", "Prefill", p.PrefillRequest(request_id="r", prompt_token_ids=[1], destination=c.TransferHandle(transfer_id="t", block_ids=[1])), INVALID, "destination.transport"),
    ("Prefill", "Prefill", p.PrefillRequest(request_id="r", prompt_token_ids=[1], sampling=c.SamplingParams(n=2), destination=TCP_HANDLE), UNIMPLEMENTED, "Prefill is not wired"),
    ("Decode", "Admit", d.AdmitRequest(), INVALID, "request_id"),
    ("Decode", "Admit", d.AdmitRequest(request_id="r", prompt_token_ids=[1]), INVALID, "gateway_id: must be set"),
    ("Decode", "Admit", d.AdmitRequest(request_id="r", prompt_token_ids=[1], gateway_id="g"), UNIMPLEMENTED, "Admit is not wired"),
    ("Decode", "Start", d.StartRequest(request_id="r"), INVALID, "first_token_ids: give the prefill worker's first tokens"),
    ("Decode", "Start", d.StartRequest(request_id="r", prefill_locally=True, prompt_token_ids=[1], gateway_id="g"), INVALID, "sampling: required with prefill_locally"),
    ("Decode", "Start", d.StartRequest(request_id="r", first_token_ids=[1, 2], first_token_logprobs=[c.TopLogprobs()]), INVALID, "first_token_logprobs"),
    ("Decode", "Start", d.StartRequest(request_id="r", first_token_ids=[5]), UNIMPLEMENTED, "Start is not wired"),
    ("Decode", "Attach", d.AttachRequest(), INVALID, "gateway_id: must be set"),
    ("Decode", "Attach", d.AttachRequest(gateway_id="g"), UNIMPLEMENTED, "Attach is not wired"),
    ("Decode", "Abort", c.AbortRequest(), INVALID, "request_id"),
    ("Decode", "Abort", c.AbortRequest(request_id="r"), UNIMPLEMENTED, "Abort is not wired"),
    ("Decode", "Handshake", d.HandshakeRequest(peer_id="p"), INVALID, "supported_transports: list at least one"),
    ("Decode", "Handshake", d.HandshakeRequest(peer_id="p", supported_transports=[0]), INVALID, "supported_transports[0]"),
    ("Decode", "Handshake", d.HandshakeRequest(supported_transports=[c.TRANSPORT_KIND_TCP]), INVALID, "peer_id: must be set"),
    ("Decode", "Handshake", d.HandshakeRequest(peer_id="p", supported_transports=[1], layout=c.KVLayout(model_id="m")), INVALID, "layout.block_size"),
    ("Decode", "Handshake", d.HandshakeRequest(peer_id="p", supported_transports=[1], layout=LAYOUT), UNIMPLEMENTED, "Handshake is not wired"),
    ("KVStore", "Connect", k.ConnectRequest(), INVALID, "layout: must describe"),
    ("KVStore", "Connect", k.ConnectRequest(layout=c.KVLayout(model_id="m", block_size=16, num_layers=1, num_kv_heads=1, head_dim=8)), INVALID, "layout.dtype"),
    ("KVStore", "Connect", k.ConnectRequest(layout=LAYOUT), UNIMPLEMENTED, "Connect is not wired"),
    ("KVStore", "Lookup", k.LookupRequest(block_hashes=[b"h"]), INVALID, "layout_id: must be set"),
    ("KVStore", "Lookup", k.LookupRequest(layout_id="L"), INVALID, "block_hashes: must contain"),
    ("KVStore", "Lookup", k.LookupRequest(layout_id="L", block_hashes=[b"h"]), UNIMPLEMENTED, "Lookup is not wired"),
    ("KVStore", "Put", [BLOCK], UNIMPLEMENTED, "Put is not wired"),
    ("KVStore", "Get", k.GetRequest(layout_id="L", block_hashes=[b"h", b""]), INVALID, "block_hashes[1]: must be 1 to 64 bytes"),
    ("KVStore", "Get", k.GetRequest(layout_id="L", block_hashes=[b"h"]), UNIMPLEMENTED, "Get is not wired"),
    ("KVStore", "Watch", k.WatchRequest(), INVALID, "layout_id: must be set"),
    ("KVStore", "Watch", k.WatchRequest(layout_id="L"), UNIMPLEMENTED, "Watch is not wired"),
]


async def invoke(channel, service: str, method: str, request):
    rpc = getattr(STUBS[service](channel), method)
    if isinstance(request, list):  # client streaming
        return await rpc(iter(request), timeout=5)
    call = rpc(request, timeout=5)
    if hasattr(call, "__aiter__"):  # server streaming
        return [response async for response in call]
    return await call


@pytest.mark.parametrize(("service", "method", "request_message", "code", "text"), CASES,
                         ids=[f"{s}.{m}-{i}" for i, (s, m, *_) in enumerate(CASES)])
async def test_bad_or_unwired_requests_get_a_precise_status(channel, service, method, request_message, code, text):
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await invoke(channel, service, method, request_message)
    assert raised.value.code() == code
    assert text in raised.value.details()


def test_every_rpc_has_a_case():
    from cleave.proto.cleave.v1 import decode_pb2, gateway_pb2, kvstore_pb2, prefill_pb2

    working = {("Gateway", "ListModels"), ("Prefill", "GetLoad"), ("Decode", "GetLoad"), ("KVStore", "Stats")}
    covered = {(service, method) for service, method, *_ in CASES} | working
    declared = {
        (svc.name, m.name)
        for module in (decode_pb2, gateway_pb2, kvstore_pb2, prefill_pb2)
        for svc in module.DESCRIPTOR.services_by_name.values()
        for m in svc.methods
    }
    assert declared == covered


async def test_list_models_comes_from_config(channel):
    response = await gateway_pb2_grpc.GatewayStub(channel).ListModels(g.ListModelsRequest())
    assert [(m.id, m.source, m.max_context_length, m.is_reasoning_model) for m in response.models] == [
        ("tiny", "org/tiny-model", 4096, True)
    ]
    assert MODEL.id == "tiny"


async def test_worker_load_and_stats_answer(channel):
    prefill = await prefill_pb2_grpc.PrefillStub(channel).GetLoad(c.GetLoadRequest())
    decode = await decode_pb2_grpc.DecodeStub(channel).GetLoad(c.GetLoadRequest())
    assert (prefill.load.worker_id, decode.load.worker_id) == ("prefill-7", "decode-3")
    assert decode.load.num_running == 0 and decode.load.num_total_blocks == 0
    stats = await kvstore_pb2_grpc.KVStoreStub(channel).Stats(k.StatsRequest())
    assert stats == k.StatsResponse()


@pytest.mark.parametrize("service", ["", "cleave.v1.Gateway", "cleave.v1.Prefill", "cleave.v1.Decode", "cleave.v1.KVStore"])
async def test_each_service_reports_serving(channel, service):
    response = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service))
    assert response.status == health_pb2.HealthCheckResponse.SERVING


async def test_reflection_lists_all_services(channel):
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    request = reflection_pb2.ServerReflectionRequest(list_services="")
    (response,) = [r async for r in stub.ServerReflectionInfo(iter([request]))]
    names = {s.name for s in response.list_services_response.service}
    assert {"cleave.v1.Gateway", "cleave.v1.Prefill", "cleave.v1.Decode", "cleave.v1.KVStore"} <= names
    file_request = reflection_pb2.ServerReflectionRequest(file_containing_symbol="cleave.v1.Decode")
    (file_response,) = [r async for r in stub.ServerReflectionInfo(iter([file_request]))]
    assert file_response.file_descriptor_response.file_descriptor_proto  # grpcurl can describe it
