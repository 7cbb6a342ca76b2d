"""The engine's disaggregation hooks with n > 1 samples, and token-only engines.

A prefill-only engine draws every sample's first token from one prefill; a decode engine
continues the samples on shared prompt blocks: seeded samples equal the colocated engine's.
With `detokenize` off an engine makes no text but the same token ids, finish reasons and
thinking-token counts.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from cleave.config import SHIPPED_MODEL_DIR
from cleave.engine.llm import LLM, build_engine_config
from cleave.engine.llm_engine import LLMEngine
from cleave.engine.request import OutputAccumulator
from cleave.errors import InvalidArgument
from cleave.generation.outputs import FinishReason
from cleave.generation.sampling_params import SamplingParams
from cleave.testing.tiny_models import write_tiny_checkpoint

ENGINE_ARGS = dict(device="cpu", dtype="float32", block_size=4, num_blocks=80, max_model_len=128)
# 10 tokens: two full blocks of 4 and a partly filled third one, shared by every sample.
PROMPT = [11, 57, 203, 9, 88, 140, 3, 77, 301, 45]
SEEDED = SamplingParams(max_tokens=9, temperature=1.0, seed=1234, n=4, ignore_eos=True)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("hooks-tiny") / "llama", "llama", seed=4)


def make_engine(path: Path, **overrides) -> LLMEngine:
    return LLMEngine(build_engine_config(path, **{**ENGINE_ARGS, **overrides}))


def run(engine: LLMEngine) -> dict[str, OutputAccumulator]:
    accumulators: dict[str, OutputAccumulator] = {}
    while engine.has_unfinished():
        for output in engine.step():
            accumulators.setdefault(output.request_id, OutputAccumulator(output.request_id)).add(output)
    return accumulators


def assert_pool_full(engine: LLMEngine) -> None:
    assert engine.kv.num_free_blocks == engine.kv.num_usable_blocks
    assert engine.num_requests == 0 and not engine.scheduler.has_unfinished()


def prefill_and_decode(path: Path, params: SamplingParams, **overrides) -> tuple[list[int], dict, LLMEngine]:
    """Prefill on one engine, copy the exported blocks into another's reservation, decode there."""
    prefill, decode = make_engine(path, **overrides), make_engine(path, **overrides)
    prefill.add_request("x", PROMPT, params, prefill_only=True)
    (output,) = prefill.step()
    assert output.finished and [s.index for s in output.outputs] == list(range(params.n))
    first_tokens = [s.token_ids[0] for s in output.outputs]
    assert prefill.scheduler.stats.num_prefill_tokens == len(PROMPT)  # one prefill for all samples
    source = prefill.handoff.export("x")
    target = decode.handoff.reserve("x", len(PROMPT))
    assert len(source) == len(target) == 3
    decode.kv_cache[:, :, target] = prefill.kv_cache[:, :, source]
    prefill.handoff.release_export("x")
    assert_pool_full(prefill)
    decode.handoff.receive("x", PROMPT, first_tokens, params)
    return first_tokens, run(decode), decode


def test_seeded_samples_equal_colocated(checkpoint):
    (expected,) = LLM(checkpoint, **ENGINE_ARGS).generate([PROMPT], SEEDED)
    first_tokens, got, decode = prefill_and_decode(checkpoint, SEEDED)
    result = got["x"].result()
    assert first_tokens == [s.token_ids[0] for s in expected.outputs]
    assert [s.token_ids for s in result.outputs] == [s.token_ids for s in expected.outputs]
    assert [s.text for s in result.outputs] == [s.text for s in expected.outputs]
    assert len({tuple(s.token_ids) for s in result.outputs}) > 1  # the samples differ
    assert all(s.finish_reason is FinishReason.LENGTH for s in result.outputs)
    assert result.usage.completion_tokens == 4 * 9
    assert decode.scheduler.stats.num_prefill_tokens == 0
    assert_pool_full(decode)


def test_prefilled_samples_share_the_prompt_blocks(checkpoint):
    decode = make_engine(checkpoint)
    reserved = decode.handoff.reserve("x", len(PROMPT))
    decode.handoff.receive("x", PROMPT, [5, 6, 7], SamplingParams(max_tokens=4, n=3, seed=1, ignore_eos=True))
    decode.step()  # every sample writes its first token: copy-on-write of the partial block
    tables = [decode.kv.block_table(f"x/{i}") for i in range(3)]
    assert all(table[:2] == reserved[:2] for table in tables)
    assert all(decode.kv.pool.ref_count(block) == 3 for block in reserved[:2])
    assert len({table[2] for table in tables}) == 3
    assert decode.kv.num_usable_blocks - decode.kv.num_free_blocks == 2 + 3
    run(decode)
    assert_pool_full(decode)


def test_first_tokens_that_end_samples(checkpoint):
    """eos as a first token ends that sample at once; the others decode; the prefill side
    exports the prompt even when a first token ends its sample."""
    decode = make_engine(checkpoint)
    eos = min(decode.eos_token_ids)
    params = SamplingParams(max_tokens=5, temperature=0.0, n=2)
    decode.handoff.reserve("x", len(PROMPT))
    decode.handoff.receive("x", PROMPT, [eos, 17], params)
    result = run(decode)["x"].result()
    assert result.outputs[0].token_ids == [eos] and result.outputs[0].finish_reason is FinishReason.STOP
    assert len(result.outputs[1].token_ids) <= 5 and result.outputs[1].token_ids[0] == 17
    assert_pool_full(decode)

    prefill = make_engine(checkpoint)
    prefill.add_request("one", PROMPT, SamplingParams(max_tokens=1, temperature=0.0), prefill_only=True)
    (output,) = prefill.step()
    assert output.finished and output.outputs[0].finish_reason is FinishReason.LENGTH
    assert len(prefill.handoff.export("one")) == 3
    prefill.handoff.release_export("one")
    assert_pool_full(prefill)


def test_first_tokens_must_match_n_and_n_must_fit_a_step(checkpoint):
    decode = make_engine(checkpoint, max_num_seqs=4)
    with pytest.raises(InvalidArgument) as error:
        decode.handoff.receive("x", PROMPT, [5, 6], SamplingParams(n=3))
    assert error.value.field == "first_tokens"
    with pytest.raises(InvalidArgument) as error:  # a group that could never be admitted
        decode.add_request("y", PROMPT, SamplingParams(n=5), prefill_only=True)
    assert error.value.field == "n" and "max_num_seqs (4)" in str(error.value)
    assert_pool_full(decode)


def test_token_only_engine_makes_the_same_tokens_without_text(checkpoint):
    params = SamplingParams(max_tokens=12, temperature=0.9, seed=3, n=2, ignore_eos=True)
    texts = LLM(checkpoint, **ENGINE_ARGS).generate([PROMPT], params)[0]
    tokens_only = LLM(checkpoint, detokenize=False, **ENGINE_ARGS).generate([PROMPT], params)[0]
    assert [s.token_ids for s in tokens_only.outputs] == [s.token_ids for s in texts.outputs]
    assert all(s.text for s in texts.outputs) and not any(s.text for s in tokens_only.outputs)
    # Stop strings are the caller's business; stop token ids still end a sample.
    stop_id = texts.outputs[0].token_ids[5]
    stopped = LLM(checkpoint, detokenize=False, **ENGINE_ARGS).generate(
        [PROMPT], SamplingParams(max_tokens=12, temperature=0.9, seed=3, stop=["zzz"], stop_token_ids=[stop_id])
    )[0].outputs[0]
    first = texts.outputs[0].token_ids.index(stop_id)
    assert stopped.token_ids == texts.outputs[0].token_ids[: first + 1]
    assert stopped.finish_reason is FinishReason.STOP and stopped.stop_reason == stop_id


@pytest.mark.skipif(not (SHIPPED_MODEL_DIR / "config.json").is_file(), reason="shipped reasoner not present")
def test_token_only_engine_counts_thinking_tokens_like_the_text_parser():
    args = dict(device="cpu", dtype="float32", max_model_len=256)
    params = SamplingParams(max_tokens=120, temperature=1.0, seed=5, n=4)
    question = "What is 9460 + 71?"
    (texts,) = LLM(SHIPPED_MODEL_DIR, **args).generate(question, params)
    (tokens_only,) = LLM(SHIPPED_MODEL_DIR, detokenize=False, **args).generate(question, params)
    assert [s.token_ids for s in tokens_only.outputs] == [s.token_ids for s in texts.outputs]
    counts = [s.num_reasoning_tokens for s in texts.outputs]
    assert all(count > 10 for count in counts)
    assert [s.num_reasoning_tokens for s in tokens_only.outputs] == counts
    assert tokens_only.usage.reasoning_tokens == texts.usage.reasoning_tokens == sum(counts)
    assert all(s.reasoning_text for s in texts.outputs) and not any(s.reasoning_text for s in tokens_only.outputs)
