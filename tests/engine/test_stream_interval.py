"""EngineConfig.stream_interval: a running request's tokens reported every N steps, in one
output; its first report and its end at once; the tokens and text the same as every step."""

from __future__ import annotations

from pathlib import Path

import pytest

from cleave.engine.config import EngineConfig, SchedulerConfig
from cleave.engine.llm_engine import LLMEngine
from cleave.engine.request import OutputAccumulator
from cleave.generation.outputs import FinishReason
from cleave.generation.sampling_params import SamplingParams
from cleave.testing.tiny_models import write_tiny_checkpoint

PROMPTS = {"a": [5, 6, 7, 8], "b": [9, 10, 11, 12, 13, 14, 15], "c": [3, 4]}
MAX_TOKENS = {"a": 11, "b": 4, "c": 16}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("stream-interval") / "qwen2", "qwen2", seed=3)


def run(checkpoint: Path, interval: int, overlap: bool, n: int = 1,
        stagger: bool = False) -> tuple[dict[str, list[int]], dict, list]:
    """Each request's report steps, the accumulated results and the outputs by step."""
    engine = LLMEngine(EngineConfig(model=str(checkpoint), dtype="float32", device="cpu", overlap_steps=overlap,
                                    stream_interval=interval, stagger_reports=stagger,
                                    scheduler=SchedulerConfig(max_model_len=128)))
    for request_id, prompt in PROMPTS.items():
        params = SamplingParams(max_tokens=MAX_TOKENS[request_id], temperature=0.0, ignore_eos=True, n=n)
        engine.add_request(request_id, prompt, params)
    reports: dict[str, list[int]] = {}
    accumulators: dict[str, OutputAccumulator] = {}
    by_step = []
    step = 0
    while engine.has_unfinished():
        outputs = engine.step()
        by_step.append(outputs)
        for output in outputs:
            reports.setdefault(output.request_id, []).append(step)
            accumulators.setdefault(output.request_id, OutputAccumulator(output.request_id)).add(output)
        step += 1
    assert engine.kv.num_free_blocks == engine.kv.num_usable_blocks and engine.num_requests == 0
    return reports, {rid: acc.result() for rid, acc in accumulators.items()}, by_step


@pytest.mark.parametrize("overlap", [False, True])
def test_reports_every_n_steps_with_the_same_tokens_text_and_ends(checkpoint, overlap):
    every, every_results, _ = run(checkpoint, 1, overlap)
    gathered, results, by_step = run(checkpoint, 3, overlap)
    for request_id in PROMPTS:
        expected, got = every_results[request_id].outputs[0], results[request_id].outputs[0]
        assert got.token_ids == expected.token_ids and len(got.token_ids) == MAX_TOKENS[request_id]
        assert got.text == expected.text and got.finish_reason is FinishReason.LENGTH
        first, *middle, last = gathered[request_id]
        assert first == every[request_id][0]  # the first report at once
        assert last == every[request_id][-1]  # and the end
        assert all((step + 1) % 3 == 0 for step in middle)  # the rest every third step
        assert len(gathered[request_id]) < len(every[request_id])
    # a gathered report holds the tokens of every step since the previous one
    assert max(len(output.outputs[0].token_ids) for outputs in by_step for output in outputs) == 3


@pytest.mark.parametrize("overlap", [False, True])
def test_staggered_reports_spread_over_the_steps_with_the_same_tokens_text_and_ends(checkpoint, overlap):
    every, every_results, _ = run(checkpoint, 1, overlap)
    staggered, results, _ = run(checkpoint, 3, overlap, stagger=True)
    middles = {}
    for phase, request_id in enumerate(PROMPTS):  # phases in arrival order: 0, 1, 2
        expected, got = every_results[request_id].outputs[0], results[request_id].outputs[0]
        assert got.token_ids == expected.token_ids and got.text == expected.text
        assert got.finish_reason is FinishReason.LENGTH
        first, *middle, last = staggered[request_id]
        assert first == every[request_id][0] and last == every[request_id][-1]  # first and end at once
        assert all((step + 1 + phase) % 3 == 0 for step in middle)  # the rest when its phase comes round
        middles[request_id] = set(middle)
    assert middles["a"] and middles["c"] and not middles["a"] & middles["c"]  # on different steps
    assert staggered != run(checkpoint, 3, overlap)[0]  # unstaggered: every request on the same steps


def test_parallel_samples_keep_their_tokens(checkpoint):
    _, every_results, _ = run(checkpoint, 1, overlap=True, n=2)
    _, results, _ = run(checkpoint, 4, overlap=True, n=2)
    for request_id in PROMPTS:
        assert [s.token_ids for s in results[request_id].outputs] == [s.token_ids for s in every_results[request_id].outputs]


def test_an_interval_under_one_is_refused(checkpoint):
    with pytest.raises(ValueError, match="stream_interval"):
        EngineConfig(model=str(checkpoint), stream_interval=0)


def test_llm_generate_reports_rarely_and_returns_what_every_step_reporting_returns(checkpoint):
    from cleave.engine.llm import BATCH_STREAM_INTERVAL, LLM

    rarely, every = LLM(checkpoint, device="cpu", max_model_len=128), LLM(checkpoint, device="cpu", max_model_len=128,
                                                                           stream_interval=1)
    assert rarely.engine.config.stream_interval == BATCH_STREAM_INTERVAL > 1
    (full,) = every.generate([5, 6, 7, 8], SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True))
    stop = full.outputs[0].text[6:9]
    params = [
        SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, logprobs=2),
        SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, stop=[stop] if stop.strip() else None),
        SamplingParams(max_tokens=9, temperature=0.8, seed=7, n=2, ignore_eos=True),
    ]
    prompts = [[5, 6, 7, 8], [5, 6, 7, 8], [9, 10, 11]]
    for got, expected in zip(rarely.generate(prompts, params), every.generate(prompts, params)):
        assert [(s.token_ids, s.text, s.finish_reason, s.stop_reason) for s in got.outputs] == [
            (s.token_ids, s.text, s.finish_reason, s.stop_reason) for s in expected.outputs]
        assert [s.logprobs for s in got.outputs] == [s.logprobs for s in expected.outputs]
        assert got.usage == expected.usage


def test_the_shipped_reasoner_splits_thinking_the_same_at_llm_generates_interval():
    from cleave.config import SHIPPED_MODEL_DIR
    from cleave.engine.llm import LLM

    prompts = ["What is 17 + 25?", "What is 9 * 8?"]
    params = [SamplingParams(max_tokens=64, temperature=0.0), SamplingParams(max_tokens=48, temperature=0.7, seed=3, n=2)]
    rarely = LLM(SHIPPED_MODEL_DIR, device="cpu").generate(prompts, params)
    every = LLM(SHIPPED_MODEL_DIR, device="cpu", stream_interval=1).generate(prompts, params)
    for got, expected in zip(rarely, every):
        assert [(s.token_ids, s.text, s.reasoning_text, s.num_reasoning_tokens, s.finish_reason) for s in got.outputs] == [
            (s.token_ids, s.text, s.reasoning_text, s.num_reasoning_tokens, s.finish_reason) for s in expected.outputs]
        assert got.usage == expected.usage
    assert any(s.reasoning_text for result in every for s in result.outputs)  # the thinking split ran
