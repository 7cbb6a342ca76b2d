"""CUDA IPC negotiated between a prefill and a decode worker process sharing one GPU: the
first transfer goes over the TCP handle it was admitted with and handshakes, later ones copy
device to device; greedy tokens equal the in-process LLM's."""

from __future__ import annotations

import asyncio

import pytest

from cleave.cli._stack import ProcessStack, StackSpec
from cleave.engine.llm import LLM
from cleave.generation.sampling_params import SamplingParams
from cleave.proto.cleave.v1 import common_pb2 as c
from cleave.proto.cleave.v1 import decode_pb2 as d
from cleave.proto.cleave.v1 import decode_pb2_grpc, prefill_pb2_grpc
from cleave.proto.cleave.v1 import prefill_pb2 as p
from cleave.rpc import aio_channel
from cleave.rpc.prefill_call import prefill_response
from tests.worker.cluster import AttachReader, greedy

pytestmark = pytest.mark.gpu

MAX_TOKENS = 16
BLOCK_SIZE = 16
GATEWAY = "handshake-test"
WORKER_ARGS = ("--dtype", "float32", "--enforce-eager", "--block-size", str(BLOCK_SIZE))
PROMPTS = [[(7 * i + 3 * j) % 400 + 5 for j in range(20 + 9 * i)] for i in range(4)]


@pytest.fixture(scope="module")
def workers(checkpoint, tmp_path_factory):
    spec = StackSpec(model=checkpoint, mode="disaggregated", grpc_port=0, http_port=None, device="cuda",
                     num_kv_blocks=256, log_level="WARNING", worker_args=WORKER_ARGS)
    stack = ProcessStack(spec, tmp_path_factory.mktemp("handshake-gpu"))
    stack.start(timeout_s=300)
    try:
        yield {child.name: child.address for child in stack.children}, stack.internal_token
    finally:
        stack.stop()


async def test_cuda_ipc_negotiated_on_one_gpu_and_tokens_match_llm(checkpoint, workers):
    addresses, token = workers
    decode_channel = aio_channel(addresses["decode-0"], internal_token=token)
    prefill_channel = aio_channel(addresses["prefill-0"], internal_token=token)
    decode = decode_pb2_grpc.DecodeStub(decode_channel)
    prefill = prefill_pb2_grpc.PrefillStub(prefill_channel)
    reader = AttachReader(decode, GATEWAY)
    try:
        handles, transfers = [], []
        for index, prompt in enumerate(PROMPTS):  # one at a time: the first one handshakes
            request_id = f"ipc-{index}"
            admitted = await decode.Admit(d.AdmitRequest(
                request_id=request_id, prompt_token_ids=prompt, sampling=greedy(MAX_TOKENS), gateway_id=GATEWAY,
                prefill_worker_id="prefill-0"))
            prefilled = await prefill_response(prefill.Prefill(p.PrefillRequest(
                request_id=request_id, prompt_token_ids=prompt, sampling=greedy(MAX_TOKENS),
                destination=admitted.handle)))
            await decode.Start(d.StartRequest(request_id=request_id, first_token_ids=prefilled.first_token_ids,
                                              gateway_id=GATEWAY))
            handles.append(admitted.handle)
            transfers.append(prefilled.transfer)
        await reader.wait_finished([f"ipc-{i}" for i in range(len(PROMPTS))], timeout_s=120)

        assert handles[0].transport == c.TRANSPORT_KIND_TCP and handles[0].control_address == addresses["decode-0"]
        assert [h.transport for h in handles[1:]] == [c.TRANSPORT_KIND_CUDA_IPC] * (len(PROMPTS) - 1)
        assert all(h.cuda_ipc_handle == handles[1].cuda_ipc_handle for h in handles[1:])  # one exported cache
        assert [t.transport for t in transfers] == [handles[i].transport for i in range(len(PROMPTS))]
        assert all(t.num_blocks == -(-len(prompt) // BLOCK_SIZE) for t, prompt in zip(transfers, PROMPTS))

        reference = await asyncio.to_thread(lambda: LLM(
            checkpoint, device="cuda", dtype="float32", enforce_eager=True, block_size=BLOCK_SIZE, num_blocks=256,
        ).generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)))
        expected = [list(output.outputs[0].token_ids) for output in reference]
        assert [reader.tokens(f"ipc-{i}") for i in range(len(PROMPTS))] == expected
    finally:
        await reader.cancel()
        await decode_channel.close()
        await prefill_channel.close()
