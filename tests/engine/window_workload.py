"""The sliding-window engine tests' shared workload: five prompts (one with n = 2) generated
together while each step checks how many blocks a decoding sequence holds, then one prompt
twice to hit the prefix cache; every output against transformers' greedy tokens."""

from __future__ import annotations

from collections.abc import Callable

from cleave.engine.llm_engine import LLMEngine
from cleave.engine.request import OutputAccumulator
from cleave.generation.sampling_params import SamplingParams


def run_to_end(engine: LLMEngine, accumulators: dict[str, OutputAccumulator]) -> None:
    while engine.has_unfinished():
        for output in engine.step():
            accumulators.setdefault(output.request_id, OutputAccumulator(output.request_id)).add(output)


def generate_checking_blocks(
    engine: LLMEngine,
    prompts: list[list[int]],
    expected: list[list[int]],
    max_tokens: int,
    held: Callable[[str], int],
    bound: int,
) -> None:
    """Prompts 0-3 greedy and prompt 4 with n = 2, at once; after every step each sequence
    that decodes holds at most `bound` blocks (`held(seq_id)`); no preemption, outputs equal
    `expected`, and the pool is whole again at the end."""
    greedy = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for index, prompt in enumerate(prompts[:4]):
        engine.add_request(f"r{index}", prompt, greedy)
    engine.add_request("pair", prompts[4], SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, n=2))
    accumulators: dict[str, OutputAccumulator] = {}
    num_checked = 0
    while engine.has_unfinished():
        for output in engine.step():
            accumulators.setdefault(output.request_id, OutputAccumulator(output.request_id)).add(output)
        for seq in engine.scheduler.running:
            if seq.num_output_tokens >= 3:  # a step that fed a sampled token was resolved
                assert held(seq.seq_id) <= bound, seq
                num_checked += 1
    assert num_checked > 100
    assert engine.scheduler.stats.num_preemptions == 0
    for index in range(4):
        (sample,) = accumulators[f"r{index}"].result().outputs
        assert sample.token_ids == expected[index], f"prompt {index}"
    pair = accumulators["pair"].result().outputs
    assert [sample.token_ids for sample in pair] == [expected[4], expected[4]]
    assert engine.kv.num_free_blocks == engine.kv.num_usable_blocks


def hit_prefix_twice(engine: LLMEngine, prompt: list[int], expected: list[int], max_tokens: int) -> int:
    """Run `prompt` twice (the second finds the first's blocks, dropped or not, in the prefix
    cache); returns the prefix-hit tokens of both runs. The outputs equal `expected`."""
    greedy = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    accumulators: dict[str, OutputAccumulator] = {}
    hits = engine.scheduler.stats.num_prefix_cache_hit_tokens
    for request_id in ("first", "again"):
        engine.add_request(request_id, prompt, greedy)
        run_to_end(engine, accumulators)
        assert accumulators[request_id].result().outputs[0].token_ids == expected
    assert engine.kv.num_free_blocks == engine.kv.num_usable_blocks
    return engine.scheduler.stats.num_prefix_cache_hit_tokens - hits
