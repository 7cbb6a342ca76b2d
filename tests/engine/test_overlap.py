"""Overlapped engine steps (`overlap_steps=True`) on CPU: exactly the plain loop's outputs
(tokens, text, stops, logprobs, seeded samples, n > 1, penalties, thinking budgets,
grammars) under chunked prefill, preemption and aborts, one `step()` call later, with every
KV block returned."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from cleave.engine.llm import LLM, build_engine_config
from cleave.engine.llm_engine import LLMEngine
from cleave.engine.request import OutputAccumulator
from cleave.generation.outputs import FinishReason
from cleave.generation.sampling_params import SamplingParams
from cleave.generation.structured_output import StructuredKind, StructuredOutput
from cleave.testing.tiny_models import write_tiny_checkpoint

TEXT_IDS = (8, 500)  # plain BPE tokens of the tiny tokenizer


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("overlap") / "llama", "llama")


def prompts(count: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(*TEXT_IDS) for _ in range(rng.randint(4, 40))] for _ in range(count)]


def summary(output) -> list[tuple]:
    return [
        (s.index, s.token_ids, s.text, s.finish_reason, s.stop_reason, s.num_tokens,
         None if s.logprobs is None else [(lp.token_id, round(lp.logprob, 5), lp.top_token_ids) for lp in s.logprobs])
        for s in output.outputs
    ]


def generate_both(checkpoint: Path, prompt_list, params, preemptions=None, **engine_args) -> dict[bool, list]:
    """Outputs of the synchronous (False) and overlapped (True) engines; `preemptions`
    collects each engine's preemption count."""
    results = {}
    for overlap in (False, True):
        llm = LLM(checkpoint, device="cpu", overlap_steps=overlap, **engine_args)
        results[overlap] = [summary(output) for output in llm.generate(prompt_list, params)]
        engine = llm.engine
        assert engine.kv.num_free_blocks == engine.kv.num_usable_blocks and not engine.has_unfinished()
        if preemptions is not None:
            preemptions[overlap] = engine.scheduler.stats.num_preemptions
    return results


@pytest.mark.parametrize(
    "engine_args",
    [
        dict(max_model_len=256, max_num_batched_tokens=256),
        dict(max_model_len=256, max_num_batched_tokens=24),  # chunked
        dict(max_model_len=96, max_num_batched_tokens=256, block_size=8, num_blocks=15),  # preempting
    ],
    ids=["batched", "chunked", "preempt"],
)
def test_greedy_equals_the_synchronous_loop(checkpoint, engine_args):
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (4, 24, 24, 16, 24, 9, 1, 24)]
    preemptions: dict[bool, int] = {}
    results = generate_both(checkpoint, prompts(8, seed=1), params, preemptions, **engine_args)
    assert results[True] == results[False]
    if "num_blocks" in engine_args:
        assert preemptions[True] > 0 and preemptions[False] > 0


def test_every_sampling_option_equals_the_synchronous_loop(checkpoint):
    prompt_list = prompts(9, seed=2)
    full, full_second = (
        output.outputs[0]
        for output in LLM(checkpoint, device="cpu", max_model_len=256, overlap_steps=False).generate(
            prompt_list[:2], SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
        )
    )
    stop_text = next(full.text[i : i + 3] for i in range(6, len(full.text) - 3) if "\ufffd" not in full.text[i : i + 3])
    params = [
        SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, stop=[stop_text]),  # late stop string
        SamplingParams(max_tokens=12, temperature=0.0, stop_token_ids=[full_second.token_ids[3]]),
        SamplingParams(max_tokens=10, temperature=0.9, top_p=0.9, seed=11, n=3, ignore_eos=True),
        SamplingParams(max_tokens=10, temperature=1.0, seed=5, ignore_eos=True, logprobs=2),
        SamplingParams(max_tokens=8, temperature=0.0, frequency_penalty=0.7, ignore_eos=True),
        SamplingParams(max_tokens=8, temperature=0.0, repetition_penalty=1.3, ignore_eos=True),
        SamplingParams(max_tokens=None, temperature=0.0, ignore_eos=True),  # runs into max_model_len
        SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, n=2),
        SamplingParams(max_tokens=7, temperature=0.0),
    ]
    results = generate_both(checkpoint, prompt_list, params, max_model_len=64, max_num_batched_tokens=64)
    assert results[True] == results[False]
    first = results[True][0][0]
    assert first[3] is FinishReason.STOP and first[4] == stop_text and stop_text not in first[2]
    stopped = results[True][1][0]
    assert stopped[1] == full_second.token_ids[: full_second.token_ids.index(stopped[4]) + 1]
    assert stopped[3] is FinishReason.STOP and stopped[4] == full_second.token_ids[3]
    assert results[True][6][0][3] is FinishReason.LENGTH


def test_abort_while_a_step_is_in_flight(checkpoint):
    args = dict(device="cpu", max_model_len=128, max_num_batched_tokens=128, seed=0)
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    prompt_list = prompts(3, seed=3)
    expected = {}
    for overlap in (False, True):
        engine = LLMEngine(build_engine_config(checkpoint, overlap_steps=overlap, **args))
        for index, prompt in enumerate(prompt_list):
            engine.add_request(f"r{index}", prompt, params)
        accumulators: dict[str, OutputAccumulator] = {}

        def consume(outputs):
            for output in outputs:
                accumulators.setdefault(output.request_id, OutputAccumulator(output.request_id)).add(output)

        for _ in range(4):
            consume(engine.step())
        assert engine.abort("r1")
        consume(engine.step())
        assert accumulators["r1"].finished
        while engine.has_unfinished():
            consume(engine.step())
        results = {key: summary(acc.result()) for key, acc in accumulators.items()}
        assert results["r1"][0][3] is FinishReason.ABORT
        assert engine.kv.num_free_blocks == engine.kv.num_usable_blocks
        expected[overlap] = results
    assert expected[True]["r0"] == expected[False]["r0"] and expected[True]["r2"] == expected[False]["r2"]
    # the aborted request's tokens: the overlapped engine reported one step fewer when it ended
    aborted_sync, aborted_overlap = expected[False]["r1"][0][1], expected[True]["r1"][0][1]
    assert aborted_overlap == aborted_sync[: len(aborted_overlap)] and len(aborted_overlap) == len(aborted_sync) - 1


def test_outputs_lag_one_call_and_stats_are_filled(checkpoint):
    engine = LLMEngine(build_engine_config(checkpoint, device="cpu", max_model_len=64, overlap_steps=True))
    engine.add_request("a", prompts(1, seed=4)[0], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    assert engine.step() == []  # the prefill is launched; its token is read next call
    stats = engine.last_stats
    assert stats.num_seqs == 1 and stats.wall_s > 0 and stats.prepare_s > 0
    counts = [sum(len(s.token_ids) for o in engine.step() for s in o.outputs) for _ in range(3)]
    assert counts == [1, 1, 1]
    assert not engine.has_unfinished()  # the last call launched nothing: max_tokens is known in advance
    assert engine.scheduler.stats.num_decode_tokens == 2  # none launched past max_tokens


def test_min_tokens_and_logit_bias_overlap_to_the_same_outputs(checkpoint):
    """min_tokens reads only how many tokens a sample has (the stand-ins keep it exact), so
    its steps overlap: a stop id the bias all but forces still ends each sample exactly after
    its min_tokens, as in the plain loop."""
    prompt_list = prompts(4, seed=11)
    forced = 77
    params = [SamplingParams(max_tokens=12, temperature=0.0, logit_bias={forced: 100.0}, stop_token_ids=[forced],
                             min_tokens=minimum) for minimum in (0, 1, 5, 9)]
    llm = LLM(checkpoint, device="cpu", overlap_steps=True)
    outputs = llm.generate(prompt_list, params)
    for output, minimum in zip(outputs, (0, 1, 5, 9)):
        (sample,) = output.outputs
        assert (sample.num_tokens, sample.finish_reason, sample.stop_reason) == (minimum + 1, FinishReason.STOP, forced)
        assert sample.token_ids[-1] == forced and forced not in sample.token_ids[:-1]
        assert sample.text == llm.tokenizer.decode(sample.token_ids[:-1])  # the stop id's text is not returned
    results = {}
    for overlap in (False, True):
        engine = LLM(checkpoint, device="cpu", overlap_steps=overlap)
        results[overlap] = [summary(output) for output in engine.generate(prompt_list, params)]
    assert results[True] == results[False]


def test_samples_that_read_their_tokens_overlap_and_lag_one_call(checkpoint):
    """A penalised sample's sampling reads its earlier tokens on the host: the step before is
    resolved between its forward and its sampling, so it overlaps like any other."""
    engine = LLMEngine(build_engine_config(checkpoint, device="cpu", max_model_len=64, overlap_steps=True))
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True, frequency_penalty=0.5)
    engine.add_request("a", prompts(1, seed=4)[0], params)
    assert engine.step() == []  # the prefill is launched; its token is read next call
    counts = [sum(len(s.token_ids) for o in engine.step() for s in o.outputs) for _ in range(3)]
    assert counts == [1, 1, 1]
    assert engine.step() == [] and not engine.has_unfinished()
    assert engine.kv.num_free_blocks == engine.kv.num_usable_blocks


CHOICES = ("yes", "no", "perhaps not", "ask again later")
REASONING = {"start_tag": "<think>", "end_tag": "</think>", "starts_in_reasoning": True}


@pytest.fixture(scope="module")
def reasoning_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama as a reasoning model whose prompt opens the think block."""
    directory = write_tiny_checkpoint(tmp_path_factory.mktemp("overlap") / "reasoner", "llama")
    (directory / "cleave_config.json").write_text(json.dumps({"reasoning": REASONING}))
    return directory


CONVERSATIONS = [[{"role": "user", "content": text}] for text in ("Will it rain?", "Is the sky blue?", "Why?")]


def host_reading_workload() -> tuple[list, list[SamplingParams]]:
    """Thinking budgets and grammars (logits processors that read each sample's tokens on the
    host) beside plain and penalised samples, over the reasoning conversations."""
    choice = StructuredOutput(StructuredKind.CHOICE, choices=CHOICES)
    schema = StructuredOutput.json_schema({"type": "object", "properties": {"n": {"enum": [1, 2, 3]}},
                                           "required": ["n"], "additionalProperties": False})
    params = [
        SamplingParams(max_tokens=40, temperature=0.0, max_thinking_tokens=3, structured_output=choice),
        SamplingParams(max_tokens=40, temperature=1.0, seed=3, n=2, max_thinking_tokens=2, structured_output=schema),
        SamplingParams(max_tokens=12, temperature=1.0, seed=8, max_thinking_tokens=4, min_thinking_tokens=2),
        SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=12, temperature=0.0, presence_penalty=0.8, ignore_eos=True),
    ]
    return [CONVERSATIONS[index % len(CONVERSATIONS)] for index in range(len(params))], params


def generate_reasoning(checkpoint: Path, device: str, overlap: bool) -> list[tuple]:
    # a cache of its own size: each engine of a CUDA process would otherwise claim 90% of the device
    llm = LLM(checkpoint, device=device, dtype="float32", overlap_steps=overlap, max_model_len=256,
              max_num_batched_tokens=48, num_blocks=64)
    conversations, params = host_reading_workload()
    results = [(summary(output), [s.reasoning_text for s in output.outputs])
               for output in llm.generate(conversations, params)]
    assert llm.engine.kv.num_free_blocks == llm.engine.kv.num_usable_blocks
    return results


def test_thinking_budgets_and_grammars_equal_the_synchronous_loop(reasoning_checkpoint):
    """The host-reading workload answers exactly as the plain loop does."""
    results = {overlap: generate_reasoning(reasoning_checkpoint, "cpu", overlap) for overlap in (False, True)}
    assert results[True] == results[False]
    (chosen,), (thought,) = results[True][0]
    assert chosen[2] in CHOICES and thought  # thought, then chose
    assert all(json.loads(sample[2])["n"] in (1, 2, 3) for sample in results[True][1][0])


@pytest.mark.gpu
def test_on_cuda_host_reading_samples_overlap_to_the_synchronous_answers(reasoning_checkpoint):
    """On the GPU, where the forward of a step really runs while the host resolves the step
    before it (and decode steps replay CUDA graphs), the host-reading workload answers as the
    plain loop does there."""
    assert generate_reasoning(reasoning_checkpoint, "cuda", True) == generate_reasoning(reasoning_checkpoint, "cuda",
                                                                                        False)


def test_penalised_samples_under_preemption_equal_the_synchronous_loop(checkpoint):
    """Samples whose sampling reads their tokens, in a cache small enough to preempt them: the
    step before is resolved inside each launch, and preempted samples recompute, as in the
    plain loop."""
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, frequency_penalty=0.5 * (i % 2),
                             repetition_penalty=1.0 + 0.2 * (i % 3 == 0)) for i, n in enumerate((24, 24, 16, 24, 9, 24))]
    preemptions: dict[bool, int] = {}
    results = generate_both(checkpoint, prompts(6, seed=21), params, preemptions, max_model_len=96,
                            max_num_batched_tokens=256, block_size=8, num_blocks=15)
    assert results[True] == results[False]
    assert preemptions[True] > 0 and preemptions[False] > 0


def test_prefill_only_steps_overlap_to_the_same_hand_offs(checkpoint):
    """A prefill worker's engine: prompts one step each, the next launched before the last is
    handed off. Each hand-off (first token and logprobs, the exported prompt KV) equals the
    plain loop's, no step runs a decode row for an exporting prompt, and the blocks come back."""
    prompt_list = [prompt[:16] + [TEXT_IDS[0]] * (16 - len(prompt)) for prompt in prompts(4, seed=21)]
    params = SamplingParams(max_tokens=8, temperature=0.8, seed=3, logprobs=2)
    hand_offs, arrivals = {}, {}
    for overlap in (False, True):
        engine = LLMEngine(build_engine_config(checkpoint, device="cpu", dtype="float32", block_size=4,
                                               max_model_len=64, max_num_batched_tokens=16, overlap_steps=overlap))
        for index, prompt in enumerate(prompt_list):
            engine.add_request(f"p{index}", prompt, params, prefill_only=True)
        got, calls = {}, []
        while engine.has_unfinished():
            outputs = engine.step()
            calls.append(([output.request_id for output in outputs], engine.last_stats.num_seqs))
            for output in outputs:
                pages = engine.handoff.export(output.request_id)
                got[output.request_id] = (summary(output), engine.kv_cache[:, :, pages].clone())
                engine.handoff.release_export(output.request_id)
        assert engine.scheduler.stats.num_decode_tokens == 0
        assert engine.kv.num_free_blocks == engine.kv.num_usable_blocks
        hand_offs[overlap], arrivals[overlap] = got, calls
    # the plain loop hands a prompt off in the call that ran it; the overlapped one a call
    # later, in the call that launched the next prompt
    assert arrivals[False] == [([f"p{i}"], 1) for i in range(4)]
    assert arrivals[True] == [([], 1), (["p0"], 1), (["p1"], 1), (["p2"], 1), (["p3"], 0)]
    for request_id, (outputs, kv) in hand_offs[False].items():
        overlapped_outputs, overlapped_kv = hand_offs[True][request_id]
        assert overlapped_outputs == outputs and torch.equal(overlapped_kv, kv)
