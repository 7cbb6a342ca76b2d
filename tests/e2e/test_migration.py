"""A decode worker process SIGKILLed while streaming: every request it served continues on the
other decode worker and ends with exactly the tokens of an uninterrupted greedy run."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal

import pytest

from cleave.cli._stack import ProcessStack, StackSpec
from cleave.client import GatewayClient
from cleave.client.gateway import collect
from cleave.engine.llm import LLM
from cleave.generation.sampling_params import SamplingParams
from cleave.proto.cleave.v1 import common_pb2, decode_pb2_grpc, gateway_pb2
from cleave.rpc import aio_channel
from tests.e2e.conftest import NUM_KV_BLOCKS, START_HANG_S
from tests.metrics.scrape import scrape, value

NUM_REQUESTS = 10
# Long streams, so the victim is still generating when every request has its first token.
MAX_TOKENS = 256


@pytest.fixture
def two_decode_stack(e2e_model, tmp_path):
    spec = StackSpec(model=e2e_model, mode="colocated", num_decode=2, grpc_port=0, http_port=None,
                     num_kv_blocks=NUM_KV_BLOCKS, log_level="WARNING")
    stack = ProcessStack(spec, tmp_path / "stack")
    try:
        stack.start(timeout_s=START_HANG_S)
        for child in stack.children:
            if child.name.startswith("decode"):
                _lower_priority(child.process.pid)
        yield stack
    finally:
        _thaw_and_stop(stack)


def _thaw_and_stop(stack: ProcessStack) -> None:
    for child in stack.children:  # a failed test may leave a worker frozen
        if child.process.poll() is None:
            os.kill(child.process.pid, signal.SIGCONT)
    stack.stop()


def _lower_priority(pid: int) -> None:
    """Nice every thread of a worker: on a busy machine the gateway and this test then run as
    soon as they can, so the freeze follows the last first token by a few steps, not hundreds
    (threads the worker starts later inherit the niceness)."""
    for thread_id in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(ProcessLookupError):
            os.setpriority(os.PRIO_PROCESS, int(thread_id), 19)


def _request(index: int) -> gateway_pb2.GenerateRequest:
    return gateway_pb2.GenerateRequest(
        request_id=f"stream-{index}",
        text=f"Request {index}: tell me about the quick brown fox and the lazy dog",
        sampling=common_pb2.SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True),
        stream=gateway_pb2.StreamOptions(include_token_ids=True),
    )


async def _counted(stream, progress: list[int], index: int):  # type: ignore[no-untyped-def]
    """Pass a Generate stream through, counting its tokens."""
    async for response in stream:
        progress[index] += sum(len(sample.token_ids) for sample in response.samples)
        yield response


async def _wait_all_first_tokens(gateway_metrics: str, timeout_s: float) -> None:
    """Until the gateway has streamed a first token of every request (its TTFT histogram),
    polling its metrics: the test's own client may read them much later on a loaded machine."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    url = f"http://{gateway_metrics}/metrics"
    while value(await asyncio.to_thread(scrape, url), "cleave:time_to_first_token_seconds_count") < NUM_REQUESTS:
        if asyncio.get_running_loop().time() > deadline:
            raise TimeoutError(f"the gateway streamed first tokens of fewer than {NUM_REQUESTS} requests in {timeout_s} s")
        await asyncio.sleep(0.01)


@pytest.mark.timeout(600)
async def test_streams_survive_a_killed_decode_worker(two_decode_stack, e2e_model):
    stack = two_decode_stack
    requests = [_request(i) for i in range(NUM_REQUESTS)]
    reference = LLM(e2e_model, device="cpu", dtype="float32", num_blocks=NUM_KV_BLOCKS, enforce_eager=True)
    expected = reference.generate([r.text for r in requests],
                                  SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True))
    workers = [child for child in stack.children if child.name.startswith("decode")]
    progress = [0] * NUM_REQUESTS

    async with GatewayClient(stack.gateway_address) as client:
        streams = [asyncio.ensure_future(collect(_counted(client.stream(r), progress, i)))
                   for i, r in enumerate(requests)]
        # Freeze both workers once the gateway has a first token of every request (a request
        # still starting on the victim would be placed again, not migrated); with MAX_TOKENS
        # long, the victim then dies with its requests mid-stream.
        await _wait_all_first_tokens(stack.metrics_addresses()["gateway"], timeout_s=60)
        for worker in workers:
            os.kill(worker.process.pid, signal.SIGSTOP)
        tokens_at_kill = sorted(progress)
        # The victim is the worker the gateway streams the most requests from (routing may put
        # them all on one, e.g. while the other missed a health check on a loaded machine, and
        # one may have finished its requests before the freeze).
        routed = await asyncio.to_thread(scrape, f"http://{stack.metrics_addresses()['gateway']}/metrics")
        started = {worker.name: value(routed, "cleave:routing_decisions_total", decode_worker=worker.name)
                   for worker in workers}
        streaming = {worker.name: value(routed, "cleave:num_decode_worker_requests", decode_worker=worker.name)
                     for worker in workers}
        assert sum(started.values()) == NUM_REQUESTS, started
        victim, survivor = sorted(workers, key=lambda worker: -streaming[worker.name])
        assert streaming[victim.name] > 0, f"every request ended before the freeze ({tokens_at_kill=}, {started=})"
        victim.process.kill()
        os.kill(survivor.process.pid, signal.SIGCONT)
        results = await asyncio.gather(*streams)
    for result, engine_output in zip(results, expected):
        (sample,) = result.samples
        assert sample.token_ids == engine_output.outputs[0].token_ids, result.request_id
        assert sample.text == engine_output.outputs[0].text
        assert sample.finish_reason == "length"
        assert result.usage.completion_tokens == MAX_TOKENS
        assert result.usage.prompt_tokens == len(engine_output.prompt_token_ids)
    assert victim.process.wait(timeout=5) == -9
    migrated = [line for line in gateway_log_lines(stack) if "request migrated" in line]
    assert migrated, f"no request moved ({tokens_at_kill=}, {started=}, {streaming=}, victim {victim.name})"
    load = await _load(survivor, stack.internal_token)
    assert (load.num_running, load.num_free_blocks) == (0, load.num_total_blocks)


async def _load(worker, internal_token: str) -> common_pb2.WorkerLoad:  # type: ignore[no-untyped-def]
    async with aio_channel(worker.address, internal_token=internal_token) as channel:
        return (await decode_pb2_grpc.DecodeStub(channel).GetLoad(common_pb2.GetLoadRequest(), timeout=5)).load


def gateway_log_lines(stack: ProcessStack) -> list[str]:
    """The gateway's log lines."""
    stack.gateway.log.flush()
    return stack.gateway.log_path.read_text(errors="replace").splitlines()
