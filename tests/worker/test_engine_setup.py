"""Worker flags -> engine config; engine outputs -> stream deltas."""

from __future__ import annotations

from cleave.config import worker_config
from cleave.engine.llm import default_model_path
from cleave.engine.outputs import CompletionOutput, FinishReason, RequestOutput, TokenLogprob
from cleave.rpc.types import TopLogprobs
from cleave.rpc.types import TokenLogprob as WireLogprob
from cleave.worker import DeltaBuilder, engine_config_from_worker, top_logprobs_from_engine


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
