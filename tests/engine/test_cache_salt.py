"""Cache salts in the engine: a salted prompt's blocks are cached, looked up, held for a
kvstore fetch and offered for a put under its salt's chain only, by the scheduler and by
`engine.handoff` alike; the output never depends on the salt."""

from __future__ import annotations

from dataclasses import replace

import pytest

from cleave.engine.llm import build_engine_config
from cleave.engine.llm_engine import LLMEngine
from cleave.generation.sampling_params import SamplingParams
from cleave.testing.tiny_models import write_tiny_checkpoint
from tests.engine.test_handoff import ENGINE_ARGS, PROMPT, run, used

GREEDY = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def engine_config(tmp_path_factory):
    path = write_tiny_checkpoint(tmp_path_factory.mktemp("salt-tiny") / "llama", "llama", seed=4)
    return build_engine_config(path, **ENGINE_ARGS)


def salted(salt: str, **overrides) -> SamplingParams:
    return replace(GREEDY, cache_salt=salt, **overrides)


def test_a_prompt_hits_the_cache_only_under_its_own_salt(engine_config):
    engine = LLMEngine(engine_config)
    engine.add_request("a", PROMPT, salted("tenant-a"))
    first = run(engine)["a"]
    for request_id, params in [("other", salted("tenant-b")), ("unsalted", GREEDY), ("again", salted("tenant-a"))]:
        engine.add_request(request_id, PROMPT, params)
    results = run(engine)
    assert first.usage.cached_prompt_tokens == 0
    assert results["other"].usage.cached_prompt_tokens == 0
    assert results["unsalted"].usage.cached_prompt_tokens == 0
    assert results["again"].usage.cached_prompt_tokens == 8  # two full blocks of 4
    # an unsalted prompt cached first is no hit for a salted one either
    engine.add_request("salted-late", PROMPT, salted("tenant-c"))
    assert run(engine)["salted-late"].usage.cached_prompt_tokens == 0
    outputs = {tuple(r.outputs[0].token_ids) for r in [first, *results.values()]}
    assert len(outputs) == 1


def test_parallel_samples_share_their_prompt_under_the_salt(engine_config):
    engine = LLMEngine(engine_config)
    engine.add_request("group", PROMPT, salted("tenant-a", n=3))
    run(engine)
    handoff = engine.handoff
    assert handoff.cached_prefix(PROMPT, "tenant-a") == 8
    assert handoff.cached_prefix(PROMPT) == 0 and handoff.cached_prefix(PROMPT, "tenant-b") == 0
    assert used(engine) == 0


def test_handoff_hashes_holds_and_cached_pages_follow_the_salt(engine_config):
    engine = LLMEngine(engine_config)
    handoff = engine.handoff
    tokens = PROMPT[:8]
    assert handoff.block_hashes(tokens, "tenant-a") != handoff.block_hashes(tokens)
    assert handoff.block_hashes(tokens, "tenant-a") != handoff.block_hashes(tokens, "tenant-b")
    hold = handoff.hold_prefix("k", tokens, "tenant-a")
    assert hold is not None and hold.num_cached_blocks == 0 and len(hold.new_block_ids) == 2
    handoff.publish_hold("k", tokens, "tenant-a")
    handoff.release_hold("k")
    assert handoff.num_cached_blocks(handoff.block_hashes(tokens, "tenant-a")) == 2
    assert handoff.num_cached_blocks(handoff.block_hashes(tokens)) == 0
    assert handoff.hold_cached("put", tokens).num_blocks == 0  # an unsalted put finds none of them
    pages = handoff.hold_cached("put-a", tokens, "tenant-a")
    assert pages.num_blocks == 2
    handoff.release_cached("put-a")
    # the prefill of a request of that salt takes the published blocks
    engine.add_request("k", PROMPT, salted("tenant-a"))
    assert run(engine)["k"].usage.cached_prompt_tokens == 8
    assert used(engine) == 0


def test_a_received_request_indexes_its_prompt_under_its_salt(engine_config):
    engine = LLMEngine(engine_config)
    handoff = engine.handoff
    handoff.reserve("r", len(PROMPT))
    handoff.receive("r", PROMPT, 5, salted("tenant-a"))
    run(engine)
    assert handoff.cached_prefix(PROMPT, "tenant-a") == 8
    assert handoff.cached_prefix(PROMPT) == 0


def test_a_prompt_scored_whole_is_indexed_under_its_salt_too(engine_config):
    """Prompt logprobs skip the prefix lookup, so the blocks are first hashed when they are
    indexed after the step: under the salt there as well."""
    engine = LLMEngine(engine_config)
    engine.add_request("scored", PROMPT, salted("tenant-a", prompt_logprobs=0))
    run(engine)
    assert engine.handoff.cached_prefix(PROMPT) == 0
    assert engine.handoff.cached_prefix(PROMPT, "tenant-a") == 8
