"""The stack as processes under `cleave up`'s supervisor survives its services' faults:

- SIGTERM to any service drains it: every request it admitted completes, token for token as
  an undisturbed greedy run, and it exits 0; the supervisor then starts it again on its
  address and the stack serves as before;
- SIGKILL of a decode worker in the middle of a burst from several clients: every request
  completes token-identical (the gateway moves the streams), the worker comes back on its
  address and is routed to again.
"""

from __future__ import annotations

import asyncio
import itertools
import signal
import time

import pytest

from cleave.cli._stack import Child, ProcessStack, StackSpec
from cleave.cli._supervisor import SupervisedStack
from cleave.client import GatewayClient, wait_until_serving
from cleave.client.gateway import collect
from cleave.engine.llm import LLM
from cleave.generation.sampling_params import SamplingParams
from cleave.proto.cleave.v1 import common_pb2, decode_pb2_grpc, gateway_pb2
from cleave.rpc import aio_channel
from tests.e2e.conftest import NUM_KV_BLOCKS, START_HANG_S

MAX_TOKENS = 32
IDS = gateway_pb2.StreamOptions(include_token_ids=True)


async def restarted_child(supervised: SupervisedStack, old: Child) -> Child:
    """The child that replaced `old`, SERVING on old's address."""
    new = await asyncio.get_running_loop().run_in_executor(None, supervised.wait_restarted, old, 90.0)
    assert new is not None, f"{old.name} did not come back: {supervised.lines}"
    assert new.address == old.address
    return new


@pytest.fixture(scope="module")
def supervised(e2e_model, tmp_path_factory):
    spec = StackSpec(model=e2e_model, mode="disaggregated", num_prefill=2, num_decode=2, grpc_port=0,
                     http_port=None, num_kv_blocks=NUM_KV_BLOCKS, log_level="WARNING")
    stack = ProcessStack(spec, tmp_path_factory.mktemp("faults"))
    stack.start(timeout_s=START_HANG_S)
    running = SupervisedStack(stack)
    yield running
    running.close()


@pytest.fixture(scope="module")
def reference(e2e_model):
    llm = LLM(e2e_model, device="cpu", dtype="float32", num_blocks=NUM_KV_BLOCKS, enforce_eager=True)

    def expected(prompts: list[str]) -> list[list[int]]:
        outputs = llm.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True))
        return [output.outputs[0].token_ids for output in outputs]

    return expected


def _migrations(supervised: SupervisedStack) -> int:
    """Requests the gateway moved to another decode worker (its log continues across restarts)."""
    return supervised.child("gateway").log_path.read_text(errors="replace").count("request migrated")


def _prompt(tag: str, index: int) -> str:
    return f"{tag} {index}: tell me about the quick brown fox and the lazy dog"


async def _complete(client: GatewayClient, prompt: str, on_token=None) -> list[int]:  # type: ignore[no-untyped-def]
    async def counted():  # type: ignore[no-untyped-def]
        async for response in client.generate(prompt, max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True,
                                              stream=IDS):
            if on_token is not None and any(sample.token_ids for sample in response.samples):
                on_token()
            yield response

    result = await collect(counted())
    (sample,) = result.samples
    assert sample.finish_reason == "length"
    return sample.token_ids


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", ["decode-0", "prefill-0", "kvstore", "gateway"])
async def test_sigterm_drains_a_service_without_losing_admitted_requests(supervised, reference, name):
    prompts = [_prompt(f"drain-{name}", index) for index in range(8)]
    expected = reference(prompts)
    victim = supervised.child(name)
    address = supervised.stack.gateway_address
    migrated = _migrations(supervised)
    streaming: set[int] = set()
    flowing = asyncio.Event()

    def has_token(index: int) -> None:
        streaming.add(index)
        if len(streaming) == len(prompts):
            flowing.set()

    async with GatewayClient(address) as client:
        tasks = [asyncio.ensure_future(_complete(client, prompt, lambda index=index: has_token(index)))
                 for index, prompt in enumerate(prompts)]
        if name != "prefill-0":  # every request admitted everywhere: none may be refused now
            await asyncio.wait_for(flowing.wait(), 60)
        # (a prefill worker drains what it is prefilling: signalled at once, it refuses the
        # prompts that had not reached it yet, and the gateway retries them on the other)
        victim.process.send_signal(signal.SIGTERM)
        results = await asyncio.wait_for(asyncio.gather(*tasks), 120)
    assert results == expected
    assert await asyncio.get_running_loop().run_in_executor(None, victim.process.wait, 30) == 0
    assert _migrations(supervised) == migrated  # drained, not lost: nothing had to move
    await restarted_child(supervised, victim)
    await wait_until_serving(address, timeout_s=60.0)


@pytest.mark.timeout(300)
async def test_a_killed_decode_worker_loses_no_request_and_comes_back(supervised, reference):
    num_clients, per_client = 4, 10
    prompts = [[_prompt(f"kill-{client}", index) for index in range(per_client)] for client in range(num_clients)]
    expected = [reference(batch) for batch in prompts]
    victim = supervised.child("decode-0")
    address = supervised.stack.gateway_address
    completed = 0
    killed = asyncio.Event()

    def maybe_kill() -> None:
        if completed >= 8 and not killed.is_set():  # a third of the way in, with streams in flight
            victim.process.kill()
            killed.set()

    async def one_client(batch: list[str]) -> list[list[int]]:
        nonlocal completed
        tokens = []
        async with GatewayClient(address) as client:
            for prompt in batch:
                tokens.append(await _complete(client, prompt, maybe_kill))
                completed += 1
        return tokens

    results = await asyncio.wait_for(asyncio.gather(*(one_client(batch) for batch in prompts)), 240)
    assert killed.is_set()
    assert results == expected
    assert victim.process.wait(timeout=5) == -signal.SIGKILL
    restarted = await restarted_child(supervised, victim)
    assert any(line.startswith("decode-0 exited with signal SIGKILL") for line in supervised.lines)
    # the gateway routes to the restarted worker again once its health checks see it SERVING
    # (about a second): bursts then reach it, and its token rate shows the work
    # Each burst's prompts are new (no prefix affinity keeps them off the restarted worker) and
    # the same in every run: their greedy tokens are compared with the in-process engine's,
    # which batches them differently, and prompts drawn afresh each run (from the clock) can
    # meet a near-tie that fp32 sums in another order decide the other way.
    deadline = time.monotonic() + 60
    for attempt in itertools.count():
        burst = [_prompt(f"after-{attempt}", index) for index in range(8)]
        async with GatewayClient(address) as client:
            assert await asyncio.gather(*(_complete(client, prompt) for prompt in burst)) == reference(burst)
        if (await _load(restarted, supervised.stack.internal_token)).tokens_per_second > 0:
            break
        assert time.monotonic() < deadline, "the restarted decode worker gets no requests"
    assert restarted.process.poll() is None


async def _load(worker: Child, internal_token: str) -> common_pb2.WorkerLoad:
    async with aio_channel(worker.address, internal_token=internal_token) as channel:
        return (await decode_pb2_grpc.DecodeStub(channel).GetLoad(common_pb2.GetLoadRequest(), timeout=5)).load
