"""--store-to-kvstore: from the gateway's flags into every PrefillRequest it sends."""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path
from typing import Any

import grpc
import pytest

from cleave.cli import up
from cleave.cli._stack import ProcessStack, StackSpec
from cleave.config import gateway_config
from cleave.generation.sampling_params import SamplingParams
from cleave.proto.cleave.v1 import decode_pb2 as d
from cleave.proto.cleave.v1 import prefill_pb2 as p
from cleave.rpc.types import ReasoningOptions
from cleave.testing.tiny_models import write_tiny_checkpoint
from services.gateway.__main__ import build
from services.gateway.backend import GenerateSpec, Prompt, Scaling, StreamShape
from services.gateway.placement import RunningRequest, WorkerRequest
from services.gateway.workers import WorkerHandle

PROMPT = [5, 6, 7, 8]


class StreamAnswer:
    """A server-streaming call that answers with fixed messages."""

    def __init__(self, messages: list[Any]) -> None:
        self._messages = list(messages)

    async def read(self) -> Any:
        return self._messages.pop(0) if self._messages else grpc.aio.EOF

    def cancel(self) -> bool:
        return False


class RecordingStub:
    """A worker stub: records each call's method and request and answers with a fixed
    response (a list: the messages of a server-streaming call)."""

    def __init__(self, responses: dict[str, Any]) -> None:
        self.calls: list[tuple[str, Any]] = []
        self._responses = responses

    def __getattr__(self, method: str):  # type: ignore[no-untyped-def]
        def call(request: Any, timeout: float | None = None) -> Any:
            self.calls.append((method, request))
            response = self._responses[method]
            if isinstance(response, list):
                return StreamAnswer(response)
            return asyncio.sleep(0, response)

        return call


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("store-option") / "llama")


@pytest.mark.parametrize(("flags", "expected"), [([], True), (["--no-store-to-kvstore"], False)])
async def test_prefill_requests_carry_the_configured_store_to_kvstore(checkpoint, flags, expected):
    argv = ["--model", str(checkpoint), "--prefill", "p:1", "--decode", "d:1", "--http-listen", "", *flags]
    _, process = build(gateway_config(argv, {}))
    backend = process.backend
    assert backend.options.store_to_kvstore is expected
    prefilled = p.PrefillResponse(first_token_ids=[9], num_prompt_tokens=4, num_cached_tokens=4)
    prefill_stub = RecordingStub({"Prefill": [prefilled, p.PrefillResponse(request_id="req-1")]})
    decode_stub = RecordingStub({"Admit": d.AdmitResponse(), "Start": d.StartResponse()})
    prefill = WorkerHandle("prefill", "p:1", None, prefill_stub, None, healthy=True)  # type: ignore[arg-type]
    decode = WorkerHandle("decode", "d:1", None, decode_stub, None, healthy=True)  # type: ignore[arg-type]
    backend.pool.workers = [prefill, decode]
    running = RunningRequest(asyncio.Queue())
    running.add(WorkerRequest("req-1", decode, None, (0,)))  # type: ignore[arg-type]
    spec = GenerateSpec("req-1", "tiny", Prompt(token_ids=tuple(PROMPT)), SamplingParams(max_tokens=4),
                        ReasoningOptions(), Scaling(), StreamShape())

    assert await backend._start(spec, PROMPT, running) == 4
    [(method, request)] = prefill_stub.calls
    assert (method, request.request_id, list(request.prompt_token_ids)) == ("Prefill", "req-1", PROMPT)
    assert request.store_to_kvstore is expected
    # One call: the prefill worker admits and starts the request on the decode worker itself.
    assert (request.decode.address, request.decode.gateway_id) == ("d:1", backend.options.gateway_id)
    assert decode_stub.calls == []
    first = running.queue.get_nowait()
    assert (first.request_id, list(first.token_ids)) == ("req-1", [9])


@pytest.mark.parametrize(("flags", "expected"), [([], True), (["--no-store-to-kvstore"], False)])
def test_cleave_up_forwards_store_to_kvstore_to_the_gateway(flags, expected, tmp_path):
    parser = argparse.ArgumentParser()
    up.register(parser.add_subparsers())
    args = parser.parse_args(["up", *flags])
    assert args.store_to_kvstore is expected
    stack = ProcessStack(StackSpec(model=Path("/models/m"), store_to_kvstore=args.store_to_kvstore), tmp_path)
    gateway_args = stack._gateway_args([])
    assert gateway_config(gateway_args, {}).store_to_kvstore is expected
