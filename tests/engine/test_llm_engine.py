"""LLMEngine on tiny random checkpoints (CPU, fp32): parity with transformers, batching,
chunked prefill, preemption, seeded sampling, parallel samples, validation, stops, aborts."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from cleave.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from cleave.engine.llm import LLM
from cleave.engine.llm_engine import LLMEngine
from cleave.engine.request import OutputAccumulator
from cleave.errors import InvalidArgument
from cleave.generation.outputs import FinishReason
from cleave.generation.sampling_params import SamplingParams
from cleave.testing.tiny_models import ARCHITECTURES, write_tiny_checkpoint
from tests.engine.hf_reference import hf_greedy_continuations

NUM_PROMPTS = 16
MAX_TOKENS = 16
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
# name -> (SchedulerConfig kwargs, CacheConfig kwargs)
MODES = {
    "batched": (dict(max_num_batched_tokens=2048, max_model_len=2048), dict(block_size=16)),
    "chunked": (dict(max_num_batched_tokens=32, max_model_len=2048), dict(block_size=16)),
    # prompts of over 12 tokens held to 12 per step while shorter ones are admitted
    "long_prefill": (dict(max_num_batched_tokens=32, max_model_len=2048, long_prefill_token_threshold=12),
                     dict(block_size=16)),
    # 16 usable blocks of 8 tokens cannot hold 16 sequences of 21-76 tokens at once
    "preempt": (dict(max_num_batched_tokens=256, max_model_len=128), dict(block_size=8, num_blocks=17)),
}


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("engine-tiny")
    return {arch: write_tiny_checkpoint(root / arch, arch, seed=index) for index, arch in enumerate(ARCHITECTURES)}


def make_prompts(vocab_size: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab_size) for _ in range(rng.randint(5, 60))] for _ in range(NUM_PROMPTS)]


@pytest.fixture(scope="session")
def hf_greedy(checkpoints: dict[str, Path]) -> dict[str, tuple[list[list[int]], list[list[int]]]]:
    """Per architecture: the prompts and transformers' greedy continuations (eos disabled)."""
    return {arch: hf_greedy_continuations(path, make_prompts, MAX_TOKENS) for arch, path in checkpoints.items()}


def make_engine(path: Path, scheduler: dict | None = None, cache: dict | None = None, seed: int = 0) -> LLMEngine:
    config = EngineConfig(
        model=str(path),
        dtype="float32",
        device="cpu",
        seed=seed,
        scheduler=SchedulerConfig(**(scheduler or dict(max_model_len=256))),
        cache=CacheConfig(**(cache or {})),
    )
    return LLMEngine(config)


def run_to_completion(engine: LLMEngine, accumulators: dict[str, OutputAccumulator]) -> None:
    while engine.has_unfinished():
        for output in engine.step():
            accumulators.setdefault(output.request_id, OutputAccumulator(output.request_id)).add(output)


def assert_pool_empty(engine: LLMEngine) -> None:
    assert engine.kv.num_free_blocks == engine.kv.num_usable_blocks
    assert engine.num_requests == 0 and not engine.scheduler.has_unfinished()


@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_greedy_matches_transformers(arch, mode, checkpoints, hf_greedy):
    prompts, expected = hf_greedy[arch]
    engine = make_engine(checkpoints[arch], *MODES[mode])
    accumulators: dict[str, OutputAccumulator] = {}
    # arrivals spread over steps: 6 now, 5 after three steps, 5 after two more
    for waves, (lo, hi) in zip((3, 2, 0), ((0, 6), (6, 11), (11, 16))):
        for index in range(lo, hi):
            engine.add_request(f"r{index}", prompts[index], GREEDY)
        for _ in range(waves):
            for output in engine.step():
                accumulators.setdefault(output.request_id, OutputAccumulator(output.request_id)).add(output)
    run_to_completion(engine, accumulators)

    for index in range(NUM_PROMPTS):
        result = accumulators[f"r{index}"].result()
        assert result.finished and result.prompt_token_ids == prompts[index]
        (sample,) = result.outputs
        assert sample.token_ids == expected[index], f"prompt {index}"
        assert sample.finish_reason is FinishReason.LENGTH and sample.num_tokens == MAX_TOKENS
        assert result.usage.prompt_tokens == len(prompts[index]) and result.usage.completion_tokens == MAX_TOKENS
    if mode == "preempt":
        assert engine.scheduler.stats.num_preemptions > 0
    if mode == "chunked":
        assert engine.scheduler.stats.num_steps > 16 + sum(len(p) for p in prompts) // 32 - 1
    assert_pool_empty(engine)


@pytest.mark.parametrize("mode", ["batched", "preempt"])
def test_repetition_penalty_matches_transformers_beside_plain_rows(mode, checkpoints, hf_greedy):
    """Every other request has a repetition penalty (over prompt and output, as transformers
    applies it): its greedy tokens are transformers' with the same penalty, the others' plain
    greedy ones, through steps that gather the penalised rows' counts kept on the device."""
    arch = ARCHITECTURES[0]
    prompts, plain = hf_greedy[arch]
    _, penalised = hf_greedy_continuations(checkpoints[arch], make_prompts, MAX_TOKENS, repetition_penalty=1.5)
    assert penalised != plain  # the penalty changes the continuations
    engine = make_engine(checkpoints[arch], *MODES[mode])
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, repetition_penalty=1.5)
    for index, prompt in enumerate(prompts):
        engine.add_request(f"r{index}", prompt, params if index % 2 else GREEDY)
    accumulators: dict[str, OutputAccumulator] = {}
    run_to_completion(engine, accumulators)
    for index in range(NUM_PROMPTS):
        (sample,) = accumulators[f"r{index}"].result().outputs
        assert sample.token_ids == (penalised if index % 2 else plain)[index], f"prompt {index}"
    assert_pool_empty(engine)


def test_seeded_sampling_is_reproducible_and_batch_independent(checkpoints):
    engine = make_engine(checkpoints["qwen3"])
    prompts = make_prompts(engine.model_config.vocab_size, seed=3)
    params = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, seed=1234, ignore_eos=True)

    def tokens(result_id: str, accumulators) -> list[int]:
        return accumulators[result_id].result().outputs[0].token_ids

    alone: dict[str, OutputAccumulator] = {}
    engine.add_request("a", prompts[0], params)
    run_to_completion(engine, alone)

    crowded: dict[str, OutputAccumulator] = {}
    for index in range(1, 6):
        other = SamplingParams(max_tokens=20, temperature=0.8, seed=None if index % 2 else index, ignore_eos=True)
        engine.add_request(f"o{index}", prompts[index], other)
    engine.step()
    engine.add_request("a", prompts[0], params)
    run_to_completion(engine, crowded)

    again: dict[str, OutputAccumulator] = {}
    engine.add_request("a", prompts[0], SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, seed=99, ignore_eos=True))
    run_to_completion(engine, again)

    assert len(tokens("a", alone)) == 12
    assert tokens("a", alone) == tokens("a", crowded)
    assert tokens("a", again) != tokens("a", alone)  # another seed, another sample
    assert_pool_empty(engine)


def test_parallel_samples_prefill_once_and_share_prompt_blocks(checkpoints):
    engine = make_engine(checkpoints["llama"], cache=dict(block_size=16, enable_prefix_caching=False))
    prompt = make_prompts(engine.model_config.vocab_size, seed=5)[0][:5] * 8  # 40 tokens: 2 full blocks + 8
    params = SamplingParams(max_tokens=10, temperature=1.0, seed=7, n=8, ignore_eos=True)
    engine.add_request("group", prompt, params)
    accumulators: dict[str, OutputAccumulator] = {}
    for output in engine.step():  # the prefill: one sequence, 40 tokens, 8 first tokens
        accumulators.setdefault(output.request_id, OutputAccumulator(output.request_id)).add(output)
    assert engine.scheduler.stats.num_prefill_tokens == len(prompt)
    for output in engine.step():  # every sample decodes: copy-on-write of the shared partial block
        accumulators[output.request_id].add(output)
    tables = [engine.kv.block_table(f"group/{i}") for i in range(8)]
    shared = tables[0][:2]
    assert all(table[:2] == shared for table in tables)
    assert all(engine.kv.pool.ref_count(block) == 8 for block in shared)
    assert len({table[2] for table in tables}) == 8  # each sample owns its last block
    assert engine.kv.num_usable_blocks - engine.kv.num_free_blocks == 2 + 8
    run_to_completion(engine, accumulators)

    result = accumulators["group"].result()
    assert engine.scheduler.stats.num_prefill_tokens == len(prompt)
    assert [s.index for s in result.outputs] == list(range(8))
    assert all(len(s.token_ids) == 10 for s in result.outputs)
    assert len({tuple(s.token_ids) for s in result.outputs}) > 1
    assert result.usage.completion_tokens == 80
    assert_pool_empty(engine)


@pytest.mark.parametrize(
    "prompt, params, field",
    [
        ("hi", SamplingParams(temperature=-0.5), "temperature"),
        ("hi", SamplingParams(top_p=0.0), "top_p"),
        ("hi", SamplingParams(top_p=1.5), "top_p"),
        ("hi", SamplingParams(max_tokens=256), "max_tokens"),
        ("", SamplingParams(), "prompt"),
        ([], SamplingParams(), "prompt"),
        ([1] * 256, SamplingParams(max_tokens=None), "prompt"),
        ([1, 2, 10**6], SamplingParams(), "prompt"),
    ],
)
def test_bad_requests_raise_invalid_argument(prompt, params, field, checkpoints):
    engine = _shared_engine(checkpoints)
    with pytest.raises(InvalidArgument) as error:
        engine.add_request("bad", prompt, params)
    assert error.value.field == field
    assert engine.num_requests == 0 and not engine.has_unfinished()


_ENGINES: dict[str, LLMEngine] = {}


def _shared_engine(checkpoints) -> LLMEngine:
    if "llama" not in _ENGINES:
        _ENGINES["llama"] = make_engine(checkpoints["llama"])  # max_model_len 256
    return _ENGINES["llama"]


def test_stop_strings_cut_the_text(checkpoints):
    llm = LLM(checkpoints["mistral"], device="cpu", max_model_len=256)
    base = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    (full,) = llm.generate("The quick brown fox", base)
    text = full.outputs[0].text
    clean = [i for i in range(4, len(text) - 3) if "\ufffd" not in text[i : i + 3]]
    assert clean, f"no clean 3-character window in {text!r}"
    stop = text[clean[0] : clean[0] + 3]

    stopped_params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, stop=[stop])
    (stopped,) = llm.generate("The quick brown fox", stopped_params)
    sample = stopped.outputs[0]
    assert sample.text == text[: text.index(stop)]
    assert sample.finish_reason is FinishReason.STOP and sample.stop_reason == stop
    assert sample.token_ids == full.outputs[0].token_ids[: len(sample.token_ids)]
    assert len(sample.token_ids) < 24
    assert_pool_empty(llm.engine)


def test_eos_and_stop_token_ids_finish_with_stop(checkpoints):
    llm = LLM(checkpoints["qwen2"], device="cpu", max_model_len=256)
    (full,) = llm.generate([5, 6, 7, 8], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    tokens = full.outputs[0].token_ids
    stop_id = tokens[4]
    (stopped,) = llm.generate([5, 6, 7, 8], SamplingParams(max_tokens=12, temperature=0.0, stop_token_ids=[stop_id]))
    sample = stopped.outputs[0]
    first = tokens.index(stop_id)
    assert sample.token_ids == tokens[: first + 1]
    assert sample.finish_reason is FinishReason.STOP and sample.stop_reason == stop_id


def test_abort_frees_blocks_and_reports_abort(checkpoints):
    engine = make_engine(checkpoints["qwen2"])
    prompts = make_prompts(engine.model_config.vocab_size, seed=9)
    for index in range(3):
        engine.add_request(f"r{index}", prompts[index], SamplingParams(max_tokens=30, ignore_eos=True, n=2))
    engine.step()
    engine.step()
    assert engine.kv.num_free_blocks < engine.kv.num_usable_blocks
    assert engine.abort("r1") and not engine.abort("missing")
    outputs = {output.request_id: output for output in engine.step()}
    aborted = outputs["r1"]
    assert aborted.finished and {s.finish_reason for s in aborted.outputs} == {FinishReason.ABORT}
    accumulators: dict[str, OutputAccumulator] = {}
    run_to_completion(engine, accumulators)
    assert set(accumulators) == {"r0", "r2"}
    assert_pool_empty(engine)


def test_prefill_only_then_prefilled_decode_matches_colocated(checkpoints):
    """The disaggregation hooks: prefill on one engine, copy KV blocks, decode on another."""
    path = checkpoints["llama"]
    prompt = make_prompts(512, seed=11)[0]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    colocated = make_engine(path)
    expected: dict[str, OutputAccumulator] = {}
    colocated.add_request("x", prompt, params)
    run_to_completion(colocated, expected)

    prefill, decode = make_engine(path), make_engine(path)
    prefill.add_request("x", prompt, params, prefill_only=True)
    (first,) = [o for o in prefill.step()]
    assert first.finished and len(first.outputs[0].token_ids) == 1 and first.outputs[0].finish_reason is None
    source = prefill.handoff.export("x")
    target = decode.handoff.reserve("x", len(prompt))
    decode.kv_cache[:, :, target] = prefill.kv_cache[:, :, source]
    prefill.handoff.release_export("x")
    assert_pool_empty(prefill)

    decode.handoff.receive("x", prompt, first.outputs[0].token_ids[0], params)
    got: dict[str, OutputAccumulator] = {}
    run_to_completion(decode, got)
    assert got["x"].result().outputs[0].token_ids == expected["x"].result().outputs[0].token_ids
    assert_pool_empty(decode)


def test_chat_prompt_and_logprobs(checkpoints):
    llm = LLM(checkpoints["qwen3"], device="cpu", max_model_len=256)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=3)
    (from_text,) = llm.generate("What is the capital of France?", params)
    (from_messages,) = llm.generate([messages], params)
    tokenizer = llm.tokenizer
    expected_prompt = tokenizer.encode(tokenizer.apply_chat_template(messages), add_special_tokens=False)
    assert from_text.prompt_token_ids == from_messages.prompt_token_ids == expected_prompt
    sample = from_text.outputs[0]
    assert len(sample.logprobs) == 6
    for token_id, logprob in zip(sample.token_ids, sample.logprobs):
        assert logprob.token_id == token_id and logprob.top_token_ids[0] == token_id  # greedy = top-1
        assert len(logprob.top_logprobs) == 3 and logprob.logprob == pytest.approx(logprob.top_logprobs[0])
    assert sample.cumulative_logprob == pytest.approx(sum(lp.logprob for lp in sample.logprobs))
