"""A failing worker's address never reaches the gateway's clients (gRPC or HTTP); the gateway
logs it with the request id instead."""

from __future__ import annotations

import json

import grpc
import httpx
import pytest
import structlog

from cleave.errors import CleaveError, InvalidArgument, ResourceExhausted, Unavailable
from cleave.proto.cleave.v1 import gateway_pb2 as g
from cleave.rpc import error_detail
from cleave.client import GatewayClient
from services.gateway.attach import WorkerLost
from services.gateway.client_errors import ClientSafeBackend, client_error, withhold_addresses
from tests.services.gateway.stack import start_stack

PROMPT = "The quick brown fox"


def test_addresses_are_withheld_and_the_rest_is_kept():
    error = WorkerLost("lost decode worker 127.0.0.1:41231: UNAVAILABLE", "worker-req-3")
    safe = client_error(error, "req-1")
    assert isinstance(safe, WorkerLost) and safe.worker_request_id == "worker-req-3"
    assert str(safe) == "lost decode worker (internal address): UNAVAILABLE (request id req-1)"
    assert safe.status_code == "UNAVAILABLE" and safe.retry_after_s == error.retry_after_s
    peer = Unavailable("Prefill on prefill worker pf-2.svc:50051 failed (UNAVAILABLE: last error: "
                       "ipv4:10.0.0.7:50051: Connection refused); retry", field="decode")
    safe = client_error(peer, "req-2")
    assert "50051" not in str(safe) and "10.0.0.7" not in str(safe) and safe.field == "decode"
    assert str(client_error(ResourceExhausted("decode pool [::1]:7001 is full"), "r")).count("(internal address)") == 1
    bug = type("Internal", (Unavailable,), {"status_code": "INTERNAL"})("worker 10.1.1.1:9 raised KeyError('x')")
    assert client_error(bug, "req-4").message == "internal error; request id req-4"
    plain = InvalidArgument("must be at most 8", field="n")  # a client's own error stays as it is
    assert client_error(plain, "r") is plain
    assert withhold_addresses("blocks[0].payload: a field, max_migrations=1") == "blocks[0].payload: a field, max_migrations=1"
    assert withhold_addresses("unix:/run/cleave/decode.sock, gone") == "(internal address), gone"


async def test_the_wrapper_keeps_chunks_and_cleans_errors():
    class Failing:
        async def start(self) -> None: ...
        async def shutdown(self) -> None: ...

        async def generate(self, spec):  # type: ignore[no-untyped-def]
            yield "chunk"
            raise Unavailable("decode worker 127.0.0.1:41231 has no open token stream")

        async def abort(self, request_id, sample_index=None):  # type: ignore[no-untyped-def]
            raise Unavailable("decode worker 127.0.0.1:41231 is gone")

    spec = type("Spec", (), {"request_id": "req-9"})()
    received = []
    with structlog.testing.capture_logs() as logs, pytest.raises(Unavailable) as raised:
        async for chunk in ClientSafeBackend(Failing()).generate(spec):  # type: ignore[arg-type]
            received.append(chunk)
    assert received == ["chunk"] and "127.0.0.1" not in str(raised.value) and "req-9" in str(raised.value)
    (entry,) = logs
    assert entry["request_id"] == "req-9" and "127.0.0.1:41231" in entry["error"]  # kept for operators
    with pytest.raises(Unavailable) as raised:
        await ClientSafeBackend(Failing()).abort("req-9")  # type: ignore[arg-type]
    assert "127.0.0.1" not in str(raised.value)


def test_an_error_that_only_gains_the_request_id_is_not_logged_but_a_withheld_one_is():
    with structlog.testing.capture_logs() as logs:
        busy = client_error(ResourceExhausted("this API key has 4 requests running"), "req-1")
        internal = client_error(ResourceExhausted("decode worker 10.0.0.7:50071 is full"), "req-2")
        crashed = client_error(CleaveError("the step thread died"), "req-3")
    assert "req-1" in str(busy) and "10.0.0.7" not in str(internal) and str(crashed).endswith("request id req-3")
    assert [entry["request_id"] for entry in logs] == ["req-2", "req-3"]


def test_the_gateway_serves_both_apis_through_the_wrapper(model_dir, tmp_path):
    from cleave.config import gateway_config
    from services.gateway.__main__ import build

    config = gateway_config(["--model", str(model_dir), "--mode", "colocated", "--decode", "127.0.0.1:1",
                             "--http-listen", "127.0.0.1:0"], {})
    servicer, process = build(config)
    assert isinstance(servicer.backend, ClientSafeBackend)
    assert process.api is not None and process.api.backend is servicer.backend


async def test_a_lost_workers_address_reaches_neither_grpc_nor_http_clients(model_dir):
    stack = await start_stack(model_dir, "colocated", num_decode=2, max_migrations=0)
    decode_addresses = [server.address for server in stack.servers[1:3]]
    try:
        with structlog.testing.capture_logs() as logs:
            async with GatewayClient(stack.gateway_address) as client:
                stream = client.generate(PROMPT, max_tokens=200, temperature=0.0, ignore_eos=True,
                                         stream=g.StreamOptions(include_token_ids=True), request_id="lost-1")
                stopped = ""
                with pytest.raises(grpc.aio.AioRpcError) as failure:
                    async for response in stream:
                        running = stack.router._running.get("lost-1")
                        if not stopped and running is not None and any(s.token_ids for s in response.samples):
                            stopped = running.decode.address
                            await _stop(stack, stopped)
            assert failure.value.code() is grpc.StatusCode.UNAVAILABLE
            details = failure.value.details()
            detail = error_detail(failure.value)
            assert "lost decode worker (internal address)" in details and "request id lost-1" in details
            assert detail is not None and "127.0.0.1" not in detail.message and "127.0.0.1" not in details

            body = await _http_stream_until_worker_lost(stack, [a for a in decode_addresses if a != stopped])
            events = [json.loads(line[len("data: "):]) for line in body.splitlines()
                      if line.startswith("data: {")]
            errors = [event["error"] for event in events if "error" in event]
            assert errors and "lost decode worker (internal address)" in errors[0]["message"]
            assert "127.0.0.1" not in body
        hidden = [entry for entry in logs if entry.get("client_message")]
        assert {entry["request_id"] for entry in hidden} >= {"lost-1"}
        assert all(any(address in entry["error"] for address in decode_addresses) for entry in hidden)
    finally:
        await stack.close()


async def _stop(stack, address: str) -> None:  # type: ignore[no-untyped-def]
    server = next(server for server in stack.servers if server.address == address)
    await server.drain(0)


async def _http_stream_until_worker_lost(stack, decode_addresses: list[str]) -> str:  # type: ignore[no-untyped-def]
    """Stream a chat completion, stop the decode worker serving it after its first token, and
    return the whole event stream."""
    body = {"model": "tiny", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 200,
            "ignore_eos": True, "temperature": 0.0, "stream": True}
    lines = []
    stopped = False
    async with httpx.AsyncClient(timeout=60) as http:
        async with http.stream("POST", f"{stack.http_url}/chat/completions", json=body) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                lines.append(line)
                if not stopped and line.startswith("data: {") and '"choices"' in line:
                    stopped = True
                    for address in decode_addresses:
                        await _stop(stack, address)
    return "\n".join(lines)
