"""Worker flags -> engine config; engine outputs -> stream deltas."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import pytest

from cleave.config import SHIPPED_MODEL_DIR, worker_config
from cleave.engine.config import EngineConfig
from cleave.engine.llm import default_model_path
from cleave.engine.memory_budget import InsufficientDeviceMemory
from cleave.generation.outputs import CompletionOutput, FinishReason, RequestOutput, TokenLogprob
from cleave.rpc.types import TopLogprobs
from cleave.rpc.types import TokenLogprob as WireLogprob
from cleave.worker import DeltaBuilder, engine_config_from_worker, load_engine, top_logprobs_from_engine
from cleave.worker import engine_setup


def test_worker_flags_become_the_engine_config():
    config = worker_config("decode", [
        "--num-blocks", "300", "--block-size", "8", "--dtype", "bfloat16", "--max-num-seqs", "32",
        "--max-num-batched-tokens", "512", "--enforce-eager", "--transfer-listen", "0.0.0.0:7000",
        "--max-context-length", "1024", "--gpu-memory-utilization", "0.5",
    ], {"CLEAVE_DEVICE": "cpu"})
    engine = engine_config_from_worker(config)
    assert (engine.model, engine.device, engine.dtype, engine.enforce_eager) == (
        str(default_model_path()), "cpu", "bfloat16", True)
    assert (engine.cache.num_blocks, engine.cache.block_size, engine.cache.gpu_memory_utilization) == (300, 8, 0.5)
    assert (engine.scheduler.max_num_seqs, engine.scheduler.max_num_batched_tokens, engine.scheduler.max_model_len) == (
        32, 512, 1024)
    assert config.kv_listen == "0.0.0.0:7000" and config.transfer_timeout_s == 30.0
    defaults = engine_config_from_worker(worker_config("prefill", [], {}))
    assert defaults.cache.num_blocks is None and defaults.dtype == "auto"


def test_deltas_carry_new_tokens_reasoning_counts_and_logprobs():
    builder = DeltaBuilder()
    logprob = TokenLogprob(token_id=7, logprob=-0.5, top_token_ids=[3, 7], top_logprobs=[-0.25, -0.5])
    first = RequestOutput("r", [], [CompletionOutput(index=0, token_ids=[9, 7], logprobs=[logprob], num_reasoning_tokens=2),
                                    CompletionOutput(index=1, text="only text")])
    leading = TopLogprobs(WireLogprob(9, -0.1, rank=1))
    (delta,) = builder.build(first, leading_logprobs=(leading,))
    assert (delta.token_ids, delta.num_reasoning_tokens, delta.finish_reason) == ((9, 7), 2, None)
    assert delta.logprobs == (leading, top_logprobs_from_engine(logprob))
    assert delta.logprobs[1].sampled == WireLogprob(7, -0.5, rank=2)
    last = RequestOutput("r", [], [CompletionOutput(index=0, token_ids=[4], num_reasoning_tokens=2,
                                                    finish_reason=FinishReason.STOP)], finished=True)
    (delta,) = builder.build(last)
    assert (delta.token_ids, delta.num_reasoning_tokens, delta.finish_reason, delta.logprobs) == (
        (4,), 0, FinishReason.STOP, ())


# A worker process whose engine finds its share of cuda:0 taken: 10 GiB free of 80, share 0.6.
REFUSING_WORKER = """
import sys
import cleave.worker.engine_setup as setup
from cleave.engine.memory_budget import DeviceMemory, kv_blocks_for_share

def refuse(config):
    kv_blocks_for_share(DeviceMemory("cuda:0", 10 * 2**30, 80 * 2**30, 2**30), 0.6, 2**30, 2**20)

setup.LLMEngine = refuse
from services.{role}.__main__ import main
sys.exit(main(sys.argv[1:]))
"""


def test_load_engine_turns_a_memory_refusal_into_a_clean_exit(monkeypatch):
    def refuse(config):
        raise InsufficientDeviceMemory("cuda:0 has 1.00 GiB free of 80.00 GiB")

    monkeypatch.setattr(engine_setup, "LLMEngine", refuse)
    with pytest.raises(SystemExit) as caught:
        asyncio.run(load_engine(EngineConfig(model=str(SHIPPED_MODEL_DIR), device="cuda")))  # resolves, then refuses
    assert caught.value.code == "error: cuda:0 has 1.00 GiB free of 80.00 GiB"


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_a_worker_without_its_memory_share_exits_with_the_reason(role):
    result = subprocess.run(
        [sys.executable, "-c", REFUSING_WORKER.format(role=role), "--listen", "127.0.0.1:0", "--device", "cpu",
         "--kv-listen", "127.0.0.1:0", "--no-log-json", "--grace-seconds", "1"],
        capture_output=True, text=True, timeout=60,
    )
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    last_line = result.stderr.strip().splitlines()[-1]
    assert last_line.startswith("error: cuda:0 has 10.00 GiB free of 80.00 GiB")
    assert "--gpu-memory-utilization 0.6" in last_line and "--num-kv-blocks" in last_line


def test_the_long_prefill_threshold_flag_reaches_the_scheduler_and_refuses_negatives():
    env = {"CLEAVE_DEVICE": "cpu"}
    config = engine_config_from_worker(worker_config("prefill", ["--long-prefill-token-threshold", "512"], env))
    assert config.scheduler.long_prefill_token_threshold == 512
    assert engine_config_from_worker(worker_config("decode", [], env)).scheduler.long_prefill_token_threshold == 0
    with pytest.raises(SystemExit, match="--long-prefill-token-threshold"):
        worker_config("prefill", ["--long-prefill-token-threshold", "-1"], env)


def test_the_stream_interval_flag_reaches_the_engine_and_refuses_zero():
    env = {"CLEAVE_DEVICE": "cpu"}
    assert engine_config_from_worker(worker_config("decode", ["--stream-interval", "4"], env)).stream_interval == 4
    assert engine_config_from_worker(worker_config("decode", [], env)).stream_interval == 2  # the served default
    assert engine_config_from_worker(worker_config("prefill", [], env)).stream_interval == 1
    with pytest.raises(SystemExit, match="--stream-interval"):
        worker_config("decode", ["--stream-interval", "0"], env)
