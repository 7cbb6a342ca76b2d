"""cleave.v1.Gateway fuzzed with hypothesis-built protobuf messages on a live colocated stack.

Generate, Abort and ListModels get arbitrary field values (integers at their type's bounds,
NaN and infinite floats, enum numbers outside the declared ones, long and odd text, nested and
repeated fields up to a cap), valid requests with a few such fields swapped in, and bytes
that do not parse (invalid UTF-8 in a string, corrupt wire format). No call may end
INTERNAL or UNKNOWN (a server fault) or run past its deadline, and the stack must still
answer a normal request afterwards.
"""

from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from cleave.proto.cleave.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from tests.services.gateway.proto_strategies import INVALID_UTF8, messages, variants, with_invalid_utf8
from tests.services.gateway.threaded_stack import threaded_stack

EXAMPLES = 300
CALL_DEADLINE_S = 20.0
SERVER_FAULTS = {grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN, grpc.StatusCode.DEADLINE_EXCEEDED,
                 grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DATA_LOSS, grpc.StatusCode.UNIMPLEMENTED}
VALID = gateway_pb2.GenerateRequest(text="Hi", sampling=common_pb2.SamplingParams(max_tokens=2))
MAX_FUZZ_TOKENS = 4
MAX_FUZZ_SAMPLES = 2
FUZZ_SETTINGS = settings(max_examples=EXAMPLES, derandomize=True, database=None, deadline=None,
                         phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))


@pytest.fixture(scope="module")
def live(model_dir):
    with threaded_stack(model_dir, "colocated") as stack:
        yield stack


@pytest.fixture(scope="module")
def channel(live):
    with grpc.insecure_channel(live.gateway_address) as channel:
        yield channel


def cheap(request: gateway_pb2.GenerateRequest) -> gateway_pb2.GenerateRequest:
    """Cap valid-but-slow output lengths and sample counts (they test no validation)."""
    if request.sampling.max_tokens == 0 or request.sampling.max_tokens > MAX_FUZZ_TOKENS:
        request.sampling.max_tokens = MAX_FUZZ_TOKENS
    if MAX_FUZZ_SAMPLES < request.sampling.n <= 1024:
        request.sampling.n = MAX_FUZZ_SAMPLES
    if MAX_FUZZ_SAMPLES < request.scaling.num_samples <= 1024:
        request.scaling.num_samples = MAX_FUZZ_SAMPLES
    return request


def status_of(call) -> grpc.StatusCode:  # type: ignore[no-untyped-def]
    """The status a call ends with (a server stream is read to its end)."""
    try:
        result = call()
        if hasattr(result, "__iter__") and not isinstance(result, (bytes, str)):
            for _ in result:
                pass
    except grpc.RpcError as error:
        return error.code()
    return grpc.StatusCode.OK


def assert_no_server_fault(code: grpc.StatusCode, request: object) -> None:
    assert code not in SERVER_FAULTS, f"{code.name} for {str(request)[:2000]}"


def test_generate_with_arbitrary_fields_never_faults(channel):
    stub = gateway_pb2_grpc.GatewayStub(channel)
    codes: set[grpc.StatusCode] = set()

    @FUZZ_SETTINGS
    @given(request=st.one_of(messages(gateway_pb2.GenerateRequest), variants(VALID)))
    def run(request: gateway_pb2.GenerateRequest) -> None:
        request = cheap(request)
        code = status_of(lambda: stub.Generate(request, timeout=CALL_DEADLINE_S))
        codes.add(code)
        assert_no_server_fault(code, request)

    run()
    # the strategy reaches both sides of validation
    assert {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT} <= codes


def test_abort_and_list_models_with_arbitrary_fields_never_fault(channel):
    stub = gateway_pb2_grpc.GatewayStub(channel)

    @FUZZ_SETTINGS
    @given(request=messages(common_pb2.AbortRequest))
    def run(request: common_pb2.AbortRequest) -> None:
        assert_no_server_fault(status_of(lambda: stub.Abort(request, timeout=CALL_DEADLINE_S)), request)

    run()
    assert status_of(lambda: stub.ListModels(gateway_pb2.ListModelsRequest(), timeout=CALL_DEADLINE_S)) \
        == grpc.StatusCode.OK


def _undecodable() -> list[tuple[str, bytes]]:
    cases = [("Generate", with_invalid_utf8(VALID, name, bad)) for name in ("request_id", "model", "text")
             for bad in INVALID_UTF8]
    cases += [("Abort", with_invalid_utf8(common_pb2.AbortRequest(), "request_id", bad)) for bad in INVALID_UTF8]
    for junk in (b"\xff\xff\xff", b"\x0a\xff", b"\x08" + b"\xff" * 11, b"\x00"):
        cases += [(method, junk) for method in ("Generate", "Abort", "ListModels")]
    return cases


@pytest.mark.parametrize(("method", "wire"), _undecodable())
def test_a_request_that_does_not_parse_is_invalid_argument(channel, method, wire):
    identity = {"request_serializer": lambda data: data, "response_deserializer": lambda data: data}
    path = f"/cleave.v1.Gateway/{method}"
    call = channel.unary_stream(path, **identity) if method == "Generate" else channel.unary_unary(path, **identity)
    assert status_of(lambda: call(wire, timeout=CALL_DEADLINE_S)) == grpc.StatusCode.INVALID_ARGUMENT


def test_the_stack_still_serves_after_the_fuzzing(live, channel):
    # runs last in this module (pytest keeps file order)
    stub = gateway_pb2_grpc.GatewayStub(channel)
    request = gateway_pb2.GenerateRequest(text="Hello", sampling=common_pb2.SamplingParams(max_tokens=3, temperature=0))
    responses = list(stub.Generate(request, timeout=CALL_DEADLINE_S))
    assert responses[-1].usage.completion_tokens >= 1
    health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=CALL_DEADLINE_S)
    assert health.status == health_pb2.HealthCheckResponse.SERVING
