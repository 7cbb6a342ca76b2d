"""`cleave up --tensor-parallel-size 2` on the CPU, colocated and disaggregated: the decode
worker is rank 0 of two gloo ranks (its own process and one it starts), stepping in lockstep
(`cleave.engine.lockstep`); disaggregated, a prefill worker (one rank) sends each rank its
slice of the KV heads over TCP. Streamed tokens equal the single-process engine's, greedy and
seeded sampling with n = 2 alike; afterwards every rank's KV pool is whole (rank 0's load
report, rank 1's count as it stops), and the second rank's process ends with the stack."""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
import time

import pytest

from cleave.cli._stack import ProcessStack, StackSpec
from cleave.client import GatewayClient
from cleave.client.gateway import collect
from cleave.engine.llm import LLM
from cleave.generation.sampling_params import SamplingParams
from cleave.proto.cleave.v1 import common_pb2, decode_pb2_grpc, gateway_pb2
from cleave.rpc import aio_channel
from cleave.testing.tiny_models import write_tiny_checkpoint
from tests.e2e.conftest import NUM_KV_BLOCKS, START_HANG_S

PROMPTS = ["The quick brown fox jumps over the lazy dog", "Numbers: one two three four five"]
MAX_TOKENS = 10
SEEDED = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.9, seed=7, n=2, ignore_eos=True)
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def tp_model(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("e2e-tp") / "model", "llama", seed=5)


@pytest.fixture(scope="module", params=["colocated", "disaggregated", "disaggregated-tls"])
def tp_stack(request, tp_model, tmp_path_factory):
    """The stack; after it stops, every service exited cleanly, the second rank is gone and
    its KV pool was whole when it stopped. "-tls": TLS everywhere, each rank's bulk KV
    endpoint included."""
    mode, _, tls = request.param.partition("-")
    spec = StackSpec(model=tp_model, mode=mode, grpc_port=0, http_port=0, num_kv_blocks=NUM_KV_BLOCKS,
                     log_level="INFO", metrics=False, decode_tensor_parallel_size=2, tls=bool(tls))
    stack = ProcessStack(spec, tmp_path_factory.mktemp(f"tp-stack-{request.param}"))
    pids: list[int] = []
    try:
        stack.start(timeout_s=START_HANG_S)
        pids = _rank_pids(stack)
        yield stack
    finally:
        stack.stop()
    assert [child.process.returncode for child in stack.children] == [0] * len(stack.children)
    assert len(pids) == 1 and not _alive(pids[0])
    stopped = re.search(r"lockstep follower stopped +num_free_blocks=(\d+) num_usable_blocks=(\d+) rank=1 "
                        r"steps=(\d+)", _decode_log(stack))
    assert stopped is not None and int(stopped.group(3)) > 0  # it stepped with rank 0, then stopped on its Stop
    assert stopped.group(1) == stopped.group(2)  # every block of rank 1 free


def _decode_log(stack: ProcessStack) -> str:
    return next(child for child in stack.children if child.name.startswith("decode")).log_path.read_text()


def _rank_pids(stack: ProcessStack) -> list[int]:
    """The pids the decode worker logged for its other ranks."""
    line = next(line for line in _decode_log(stack).splitlines() if "tensor-parallel ranks started" in line)
    return json.loads(re.search(r"pids=(\[[0-9, ]*\])", line).group(1))  # type: ignore[union-attr]


def _alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie, exited but not reaped, counts as ended)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rpartition(")")[2].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.timeout(600)
async def test_a_two_rank_decode_worker_streams_the_single_rank_engines_tokens(tp_stack, tp_model):
    engine = LLM(tp_model, device="cpu", dtype="float32", num_blocks=NUM_KV_BLOCKS, enforce_eager=True)
    expected = {
        "greedy": engine.generate(PROMPTS, GREEDY),
        "seeded": engine.generate(PROMPTS, SEEDED),
    }
    async with GatewayClient(tp_stack.gateway_address, credentials=tp_stack.channel_credentials()) as client:
        for name, params in (("greedy", GREEDY), ("seeded", SEEDED)):
            results = await asyncio.gather(*(
                collect(client.generate(prompt, max_tokens=params.max_tokens, temperature=params.temperature,
                                        seed=params.seed, n=params.n, ignore_eos=True,
                                        stream=gateway_pb2.StreamOptions(include_token_ids=True)))
                for prompt in PROMPTS
            ))
            for result, reference in zip(results, expected[name], strict=True):
                assert [s.token_ids for s in result.samples] == [s.token_ids for s in reference.outputs], name
                assert all(len(s.token_ids) == MAX_TOKENS for s in result.samples)
    assert all(_alive(pid) for pid in _rank_pids(tp_stack))
    decode = next(child for child in tp_stack.children if child.name.startswith("decode"))
    await _wait_pool_full(decode, tp_stack)
    if tp_stack.spec.mode == "disaggregated":  # the KV came from the prefill worker, to both ranks
        assert "tensor-parallel KV receivers listening" in _decode_log(tp_stack)
        prefill = next(child for child in tp_stack.children if child.name.startswith("prefill"))
        assert "Prefill/Prefill" in prefill.log_path.read_text()


async def _wait_pool_full(worker, stack: ProcessStack) -> None:  # type: ignore[no-untyped-def]
    """Rank 0's KV pool whole again (GetLoad; releases apply between engine steps)."""
    async with aio_channel(worker.address, internal_token=stack.internal_token,
                           credentials=stack.channel_credentials()) as channel:
        stub = decode_pb2_grpc.DecodeStub(channel)
        deadline = time.monotonic() + 30
        while True:
            load = (await stub.GetLoad(common_pb2.GetLoadRequest(), timeout=5)).load
            if load.num_free_blocks == load.num_total_blocks and load.num_running == load.num_waiting == 0:
                return
            assert time.monotonic() < deadline, f"KV pool not back to full: {load}"
            await asyncio.sleep(0.05)


def test_tensor_parallel_decode_workers_are_refused_in_conditional_mode(tp_model, tmp_path):
    StackSpec(model=tp_model, mode="disaggregated", decode_tensor_parallel_size=2)  # allowed now
    with pytest.raises(ValueError, match="--mode conditional is not tested"):
        StackSpec(model=tp_model, mode="conditional", decode_tensor_parallel_size=2)
    completed = subprocess.run(
        [sys.executable, "-m", "cleave.cli.main", "up", "--model", str(tp_model), "--tensor-parallel-size", "2",
         "--mode", "conditional", "--workdir", str(tmp_path)], capture_output=True, text=True, timeout=120,
    )
    assert completed.returncode == 2 and "Traceback" not in completed.stderr
    assert completed.stderr.startswith("error: --tensor-parallel-size 2:") and "--mode disaggregated" in completed.stderr
