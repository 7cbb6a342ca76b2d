"""Prefill graphs in the engine (`EngineConfig.prefill_graph_max_tokens`): one sequence's
prefill padded into a token-count bucket generates and caches what the eager forward does.
On CPU nothing is captured and the padded forward runs eagerly: the same computation a
replay runs, so the padding (no KV written for padded rows, no real query seeing one) is
what this checks; tests/graphs/test_prefill_runner.py replays the graphs on a GPU."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from cleave.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from cleave.engine.llm_engine import LLMEngine
from cleave.generation.sampling_params import SamplingParams
from cleave.graphs.prefill import PrefillGraphConfig
from cleave.testing.tiny_models import write_tiny_checkpoint

SHARED = list(range(40, 72))  # two full 16-token blocks: a cached prefix for the second prompt
PROMPTS = {"short": [5, 6, 7], "mid": list(range(3, 40)), "prefix-a": SHARED + [9, 8, 7], "prefix-b": SHARED + [1, 2]}


@pytest.fixture(scope="module", params=["llama", "gpt-oss", "qwen3-moe"])
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("prefill-graphs") / request.param, request.param, seed=5)


MAX_MODEL_LEN = 128


def engine_for(checkpoint: Path, max_tokens: int, device: str = "cpu") -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(checkpoint), dtype="float32", device=device,
                                  prefill_graph_max_tokens=max_tokens,
                                  scheduler=SchedulerConfig(max_model_len=MAX_MODEL_LEN, max_num_seqs=4),
                                  cache=CacheConfig(num_blocks=64)))  # a small cache, also on a GPU


def generate_one_at_a_time(checkpoint: Path, max_tokens: int, device: str = "cpu") -> tuple[dict, torch.Tensor, list[int]]:
    """Each prompt alone (every prefill a one-sequence step): greedy tokens and logprobs by
    request, the KV cache afterwards, and the bucket of every prefill that took the graph path."""
    engine = engine_for(checkpoint, max_tokens, device)
    buckets: list[int] = []
    graphs = engine.runner.prefill_graphs
    if graphs is not None:
        run = graphs.run

        def spy(input_ids, positions, metadata, bucket):  # type: ignore[no-untyped-def]
            buckets.append(bucket)
            return run(input_ids, positions, metadata, bucket)

        graphs.run = spy  # type: ignore[method-assign]
    results = {}
    for request_id, prompt in PROMPTS.items():
        engine.add_request(request_id, prompt, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True,
                                                              logprobs=2))
        while engine.has_unfinished():
            for output in engine.step():
                sample = output.outputs[0]
                tokens, logprobs = results.setdefault(request_id, ([], []))
                tokens.extend(sample.token_ids)
                logprobs.extend(entry.logprob for entry in sample.logprobs)
    kv_cache = engine.runner.kv_cache.clone()
    engine.close()
    return results, kv_cache, buckets


def test_a_padded_prefill_generates_and_caches_what_the_eager_one_does(checkpoint):
    eager, eager_kv, no_buckets = generate_one_at_a_time(checkpoint, 0)
    padded, padded_kv, buckets = generate_one_at_a_time(checkpoint, 48)
    assert no_buckets == []
    # short -> 32, mid (37 tokens) -> 48, prefix-a (35) -> 48, prefix-b: 2 tokens after its cached 32 -> 32
    assert buckets == [32, 48, 48, 32]
    for request_id in PROMPTS:
        assert padded[request_id][0] == eager[request_id][0]
        assert padded[request_id][1] == pytest.approx(eager[request_id][1], abs=1e-5)
    torch.testing.assert_close(padded_kv, eager_kv, atol=1e-5, rtol=1e-5)  # padding wrote no KV


@pytest.mark.gpu
def test_gpu_replayed_prefills_generate_what_eager_ones_do(checkpoint):
    eager, eager_kv, _ = generate_one_at_a_time(checkpoint, 0, "cuda")
    replayed, replayed_kv, buckets = generate_one_at_a_time(checkpoint, 48, "cuda")
    assert buckets == [32, 48, 48, 32]
    for request_id in PROMPTS:
        assert replayed[request_id][0] == eager[request_id][0]
        assert replayed[request_id][1] == pytest.approx(eager[request_id][1], abs=1e-3)
    torch.testing.assert_close(replayed_kv, eager_kv, atol=1e-3, rtol=1e-3)


def test_graphs_stop_short_of_the_context_a_prompt_cannot_fill(tmp_path):
    """A limit past the context (the workers' 1024 with --max-context-length 128): the largest
    graph holds max_model_len - 1 tokens, the most a prompt may have (one new token must fit),
    so no bucket fills the context its padded metadata claims."""
    engine = engine_for(write_tiny_checkpoint(tmp_path / "llama", "llama"), 1024)
    assert engine.runner.prefill_graphs.buckets[-1] == MAX_MODEL_LEN - 1
    engine.close()
    for max_tokens in (0, 128, 129):
        with pytest.raises(ValueError, match=r"max_tokens must be in \[1, 128\)"):
            PrefillGraphConfig(max_tokens=max_tokens, max_blocks_per_seq=8, block_size=16)


@pytest.mark.gpu
def test_gpu_graphs_captured_up_to_the_context_generate_what_eager_ones_do(checkpoint):
    """On CUDA a limit past the context once captured a bucket filling it, whose eager warm-up
    took the dense path over the padding's slots: a device-side assert, and every later CUDA
    call of the worker failed (it could not start)."""
    eager, _, _ = generate_one_at_a_time(checkpoint, 0, "cuda")
    replayed, _, buckets = generate_one_at_a_time(checkpoint, 1024, "cuda")
    assert buckets == [32, 48, 48, 32]
    for request_id in PROMPTS:
        assert replayed[request_id][0] == eager[request_id][0]


def test_a_negative_limit_is_refused():
    with pytest.raises(ValueError, match="prefill_graph_max_tokens"):
        EngineConfig(model="m", prefill_graph_max_tokens=-1)


def test_a_capture_failure_that_left_the_device_unusable_is_raised_not_run_around(monkeypatch):
    """Falling back to eager prefill after a failed capture only helps while the device still
    runs work; after a device-side assert the context is gone and the worker must stop, naming
    the cause and the flag that avoids it."""
    from cleave.engine.model_runner import _check_device_usable

    first = RuntimeError("CUDA error: device-side assert triggered")
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    assert _check_device_usable(torch.device("cuda"), "capturing", "--flag 0", first) is None

    def lost(device=None):  # type: ignore[no-untyped-def]
        raise RuntimeError("CUDA error: device-side assert triggered (again)")

    monkeypatch.setattr(torch.cuda, "synchronize", lost)
    with pytest.raises(RuntimeError, match=r"capturing left the CUDA context unusable .*--flag 0") as raised:
        _check_device_usable(torch.device("cuda"), "capturing", "--flag 0", first)
    assert raised.value.__cause__ is first
