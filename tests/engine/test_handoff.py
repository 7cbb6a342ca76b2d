"""`engine.handoff` (KVHandoff): who holds which blocks, counted exactly through `snapshot()`.

A tiny engine with blocks of 4 tokens and 79 usable blocks; a fresh pool hands out block ids
1, 2, 3, ... in order, so tests can name the exact blocks a call takes.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from cleave.engine.handoff import KVSnapshot, PrefixHold
from cleave.engine.llm import build_engine_config
from cleave.engine.llm_engine import LLMEngine
from cleave.engine.request import OutputAccumulator
from cleave.errors import InvalidArgument, NotFound
from cleave.generation.outputs import RequestOutput
from cleave.generation.sampling_params import SamplingParams
from cleave.kv.block_pool import OutOfBlocksError
from cleave.testing.tiny_models import write_tiny_checkpoint

ENGINE_ARGS = dict(device="cpu", dtype="float32", block_size=4, num_blocks=80, max_model_len=128)
USABLE = 79
# 10 tokens: two full blocks of 4 and a partly filled third one.
PROMPT = [11, 57, 203, 9, 88, 140, 3, 77, 301, 45]
GREEDY = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("handoff-tiny") / "llama", "llama", seed=4)


def make_engine(path: Path, **overrides) -> LLMEngine:
    return LLMEngine(build_engine_config(path, **{**ENGINE_ARGS, **overrides}))


def run(engine: LLMEngine) -> dict[str, RequestOutput]:
    """Step until idle; each request's whole result."""
    accumulators: dict[str, OutputAccumulator] = {}
    while engine.has_unfinished():
        for output in engine.step():
            accumulators.setdefault(output.request_id, OutputAccumulator(output.request_id)).add(output)
    return {request_id: accumulator.result() for request_id, accumulator in accumulators.items()}


def used(engine: LLMEngine) -> int:
    return engine.handoff.snapshot().num_used_blocks


def test_snapshot_counts_free_and_usable_blocks(checkpoint):
    engine = make_engine(checkpoint)
    assert engine.handoff.snapshot() == KVSnapshot(num_free_blocks=USABLE, num_usable_blocks=USABLE)
    engine.handoff.reserve("r", len(PROMPT))
    assert engine.handoff.snapshot() == KVSnapshot(num_free_blocks=USABLE - 3, num_usable_blocks=USABLE)
    assert engine.handoff.snapshot().num_used_blocks == 3


def test_reserve_then_release_frees_exactly_the_reserved_blocks(checkpoint):
    engine = make_engine(checkpoint)
    handoff = engine.handoff
    assert handoff.reserve("a", len(PROMPT)) == [1, 2, 3]
    assert handoff.reserve("b", 5) == [4, 5]
    assert used(engine) == 5
    handoff.release("a")
    assert used(engine) == 2  # b's two blocks stay reserved
    handoff.release("a")  # idempotent: nothing is freed twice
    handoff.release("never-reserved")
    assert used(engine) == 2
    assert handoff.reserve("c", 4) == [6]  # never-used blocks first, a's freed ones after
    handoff.release("b")
    handoff.release("c")
    assert used(engine) == 0


def test_a_second_reservation_of_one_request_id_is_refused_naming_it(checkpoint):
    engine = make_engine(checkpoint)
    assert engine.handoff.reserve("twice", len(PROMPT)) == [1, 2, 3]
    with pytest.raises(InvalidArgument, match="already holds KV blocks") as raised:
        engine.handoff.reserve("twice", 5)
    assert raised.value.field == "request_id" and used(engine) == 3  # the first reservation stands
    engine.handoff.release("twice")
    assert used(engine) == 0


def test_reserve_raises_when_the_pool_is_short_and_takes_nothing(checkpoint):
    engine = make_engine(checkpoint)
    with pytest.raises(OutOfBlocksError):
        engine.handoff.reserve("big", (USABLE + 1) * 4)
    assert used(engine) == 0
    assert engine.handoff.num_blocks_for(len(PROMPT)) == 3 and engine.handoff.block_size == 4


def test_receive_takes_over_the_reservation_and_the_engine_frees_it(checkpoint):
    engine = make_engine(checkpoint)
    handoff = engine.handoff
    handoff.reserve("x", len(PROMPT))
    with pytest.raises(InvalidArgument):  # one first token for two samples: nothing taken
        handoff.receive("x", PROMPT, [5], SamplingParams(n=2))
    assert used(engine) == 3  # still the caller's reservation
    state = handoff.receive("x", PROMPT, [5, 6], SamplingParams(max_tokens=3, n=2, ignore_eos=True))
    assert state.request_id == "x" and used(engine) == 3  # both samples share the prompt's blocks
    final = run(engine)["x"]
    assert [len(sample.token_ids) for sample in final.outputs] == [3, 3]
    assert [sample.token_ids[0] for sample in final.outputs] == [5, 6]
    assert used(engine) == 0 and engine.num_requests == 0


def test_export_after_a_prefill_only_request_then_release(checkpoint):
    engine = make_engine(checkpoint)
    handoff = engine.handoff
    engine.add_request("p", PROMPT, SamplingParams(max_tokens=4, n=2, seed=1), prefill_only=True)
    (output,) = engine.step()
    assert output.finished and [len(sample.token_ids) for sample in output.outputs] == [1, 1]
    assert handoff.export("p") == [1, 2, 3]  # the prompt's blocks, in token order, kept once for both samples
    assert used(engine) == 3  # the samples ended; only the export holds blocks
    assert engine.handoff.export("p") == [1, 2, 3]  # the engine's older name
    handoff.release_export("p")
    assert used(engine) == 0
    with pytest.raises(NotFound):
        handoff.export("p")
    handoff.release_export("p")  # idempotent
    assert used(engine) == 0


def test_abort_releases_an_export(checkpoint):
    engine = make_engine(checkpoint)
    engine.add_request("p", PROMPT, SamplingParams(max_tokens=1), prefill_only=True)
    engine.step()
    assert used(engine) == 3
    engine.abort("p")
    assert used(engine) == 0


def test_cached_prefix_after_a_finished_request(checkpoint):
    engine = make_engine(checkpoint)
    handoff = engine.handoff
    assert handoff.cached_prefix(PROMPT) == 0
    engine.add_request("done", PROMPT, GREEDY)
    run(engine)
    assert used(engine) == 0  # cached free blocks count as free
    # Two full blocks; the third is partly filled and the last token is always computed.
    assert handoff.cached_prefix(PROMPT) == 8
    assert handoff.cached_prefix(PROMPT[:8]) == 4  # 8 tokens: only the first block may be reused
    assert handoff.cached_prefix([999] + PROMPT[1:]) == 0  # chained hashes: a different start misses
    assert handoff.num_cached_blocks(handoff.block_hashes(PROMPT)) == 2
    # What it predicts is what the scheduler reuses.
    engine.add_request("again", PROMPT, GREEDY)
    assert run(engine)["again"].usage.cached_prompt_tokens == 8


def test_cached_prefix_is_zero_without_prefix_caching(checkpoint):
    engine = make_engine(checkpoint, enable_prefix_caching=False)
    engine.add_request("done", PROMPT, GREEDY)
    run(engine)
    assert engine.handoff.cached_prefix(PROMPT) == 0


def test_kvstore_hold_publish_and_release(checkpoint):
    engine = make_engine(checkpoint)
    handoff = engine.handoff
    tokens = PROMPT[:8]  # two full blocks, as a kvstore fetch loads them
    hashes = handoff.block_hashes(tokens)
    assert len(hashes) == 2 and handoff.num_cached_blocks(hashes) == 0
    hold = handoff.hold_prefix("k", tokens)
    assert hold == PrefixHold(num_cached_blocks=0, new_block_ids=[1, 2])
    assert used(engine) == 2
    assert handoff.num_cached_blocks(hashes) == 0  # not published yet: no one may reuse unfilled blocks
    handoff.publish_hold("k", tokens)
    assert handoff.num_cached_blocks(hashes) == 2 and handoff.cached_prefix(PROMPT) == 8
    # A second hold of the same prefix shares the published blocks.
    assert handoff.hold_prefix("k2", tokens) == PrefixHold(num_cached_blocks=2, new_block_ids=[])
    assert used(engine) == 2
    # The prefill reuses the held blocks.
    engine.add_request("k", PROMPT, GREEDY)
    assert run(engine)["k"].usage.cached_prompt_tokens == 8
    assert used(engine) == 2  # the holds keep them until released
    handoff.release_hold("k")
    assert used(engine) == 2
    handoff.release_hold("k2")
    handoff.release_hold("k2")  # idempotent
    assert used(engine) == 0
    assert handoff.num_cached_blocks(hashes) == 2  # released, still cached


def test_kvstore_hold_released_unpublished_leaves_nothing_cached(checkpoint):
    engine = make_engine(checkpoint)
    handoff = engine.handoff
    tokens = PROMPT[:8]
    assert handoff.hold_prefix("k", tokens) == PrefixHold(0, [1, 2])
    handoff.release_hold("k")
    assert used(engine) == 0 and handoff.num_cached_blocks(handoff.block_hashes(tokens)) == 0


def test_kvstore_hold_without_room_holds_nothing(checkpoint):
    engine = make_engine(checkpoint)
    handoff = engine.handoff
    handoff.reserve("big", (USABLE - 1) * 4)  # one block left
    assert handoff.hold_prefix("k", PROMPT[:8]) is None
    assert used(engine) == USABLE - 1
    handoff.release_hold("k")  # nothing held: no-op
    handoff.release("big")
    assert used(engine) == 0


def test_new_reservations_wait_while_a_preempted_sequence_waits_to_be_recomputed(checkpoint):
    # 7 usable blocks of 4 tokens: two received 10-token prompts (3 blocks each) outgrow the
    # pool at token 13, and the later arrival is preempted, its blocks freed. Those go to its
    # recompute, not to a new arrival of its priority or a less urgent one; a more urgent one
    # (-1) may take them, and once it is running again reservations are taken as before.
    engine = make_engine(checkpoint, num_blocks=8, max_model_len=28)
    handoff, scheduler = engine.handoff, engine.handoff.scheduler
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    tokens: dict[str, int] = {}

    def step() -> None:
        for output in engine.step():
            tokens[output.request_id] = tokens.get(output.request_id, 0) + len(output.outputs[0].token_ids)

    for request_id in ("early", "late"):
        handoff.reserve(request_id, len(PROMPT))
        handoff.receive(request_id, PROMPT, [5], params)
    while not scheduler.num_preempted_ahead_of(0):
        assert engine.has_unfinished()
        step()
    assert [seq.seq_id for seq in scheduler.waiting] == ["late/0"] and engine.handoff.snapshot().num_free_blocks >= 1
    assert scheduler.num_preempted_ahead_of(-1) == 0 and scheduler.num_preempted_ahead_of(5) == 1

    with pytest.raises(OutOfBlocksError, match="preempted"):
        handoff.reserve("newcomer", 4, priority=0)
    with pytest.raises(OutOfBlocksError, match="preempted"):
        handoff.reserve("newcomer", 4, priority=3)
    assert handoff.reserve("urgent", 4, priority=-1) and handoff.reserve("unchecked", 4)
    handoff.release("urgent")
    handoff.release("unchecked")

    while scheduler.num_preempted_ahead_of(0):
        step()
    assert handoff.reserve("newcomer", 4, priority=0)
    handoff.release("newcomer")
    while engine.has_unfinished():
        step()
    assert tokens == {"early": 8, "late": 8}
    assert used(engine) == 0
