"""`cleave.engine.lockstep` in one process: a follower engine fed the leader's published ops
makes every step's outputs the leader made (requests added between steps, aborts of
requests and samples, unseeded random sampling with n > 1, KV reservations and received
requests with the leader's block ids), and the leader refuses what it cannot mirror. The multi-process path (real ranks, gloo) is tests/e2e/test_tensor_parallel_stack.py."""

from __future__ import annotations

import multiprocessing
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from cleave.engine.llm import build_engine_config
from cleave.engine.llm_engine import LLMEngine
from cleave.engine.handoff import KVSnapshot
from cleave.engine.lockstep import (
    AbortSample,
    Add,
    LockstepChannel,
    LockstepEngine,
    Receive,
    Release,
    ReportKV,
    Reserve,
    Step,
    Stop,
    follow,
)
from cleave.errors import FailedPrecondition
from cleave.generation.sampling_params import SamplingParams
from cleave.testing.tiny_models import write_tiny_checkpoint

ENGINE_ARGS = dict(device="cpu", dtype="float32", block_size=4, num_blocks=96, max_model_len=128)


class RecordingChannel:
    """The leader's side of a channel that keeps what it publishes (no other rank)."""

    rank = 0
    world_size = 1

    def __init__(self) -> None:
        self.published: list[list[Any]] = []

    def publish(self, ops: list[Any]) -> None:
        self.published.append(list(ops))

    def agree(self, name: str, value: Any) -> None:
        pass

    def close(self) -> None:
        pass


class ReplayChannel(RecordingChannel):
    """A follower's side: hands out the leader's batches in order."""

    def __init__(self, batches: list[list[Any]]) -> None:
        super().__init__()
        self._batches = iter(batches)

    def receive(self) -> list[Any]:
        return next(self._batches)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("lockstep-tiny") / "llama", "llama", seed=6)


def _step_tokens(outputs) -> dict[tuple[str, int], tuple[list[int], str | None]]:  # type: ignore[no-untyped-def]
    return {(o.request_id, s.index): (list(s.token_ids), s.finish_reason) for o in outputs for s in o.outputs}


def test_a_follower_fed_the_leaders_ops_makes_the_same_outputs_every_step(checkpoint):
    channel = RecordingChannel()
    leader = LockstepEngine(build_engine_config(checkpoint, **ENGINE_ARGS), channel)  # type: ignore[arg-type]
    unseeded = SamplingParams(max_tokens=10, temperature=1.0, n=2, ignore_eos=True)
    leader.add_request("a", [5, 17, 99, 4, 250, 31], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    leader.add_request("b", [8, 8, 120, 66], unseeded)
    leader_steps = []
    for step in range(40):
        if step == 2:
            leader.add_request("c", [300, 41, 7], unseeded)  # between steps
        if step == 4:
            assert leader.abort_sample("b", 1)
        if step == 5:
            assert leader.abort("c")
            assert not leader.abort("unknown")  # nothing to mirror
        if not leader.has_unfinished():
            break
        leader_steps.append(_step_tokens(leader.step()))
    leader.close()
    assert channel.published[-1] == [Stop()]
    assert all(batch[-1] == Step() for batch in channel.published[:-1])
    assert [op.request_id for batch in channel.published for op in batch if isinstance(op, Add)] == ["a", "b", "c"]

    follower = LLMEngine(build_engine_config(checkpoint, **ENGINE_ARGS))
    follower_steps = []
    step = follower.step
    follower.step = lambda: _record(follower_steps, step())  # type: ignore[method-assign]
    assert follow(follower, ReplayChannel(channel.published)) == len(leader_steps)  # type: ignore[arg-type]
    assert follower_steps == leader_steps
    finished = {key: reason for outputs in leader_steps for key, (_, reason) in outputs.items() if reason}
    assert finished == {("a", 0): "length", ("b", 0): "length", ("b", 1): "abort", ("c", 0): "abort", ("c", 1): "abort"}


def _record(steps: list, outputs):  # type: ignore[no-untyped-def]
    steps.append(_step_tokens(outputs))
    return outputs


def test_the_leader_refuses_the_prefill_side_of_kv_hand_off_and_prefill_only_requests(checkpoint):
    leader = LockstepEngine(build_engine_config(checkpoint, **ENGINE_ARGS), RecordingChannel())  # type: ignore[arg-type]
    for call in (lambda: leader.handoff.export("r"), lambda: leader.handoff.hold_prefix("r", [1, 2, 3, 4]),
                 lambda: leader.handoff.publish_hold("r", [1, 2, 3, 4])):
        with pytest.raises(FailedPrecondition, match="--tensor-parallel-size"):
            call()
    with pytest.raises(FailedPrecondition, match="prefill-only"):
        leader.add_request("p", [1, 2, 3, 4], SamplingParams(max_tokens=1), prefill_only=True)
    assert not leader.has_unfinished()
    assert leader.handoff.cached_prefix([1, 2, 3, 4, 5, 6, 7, 8, 9]) == 0  # lookups still answer


def test_a_follower_fed_the_leaders_hand_off_ops_reserves_the_same_blocks_and_decodes_alike(checkpoint):
    """Reservations, releases and received requests go out at once (an idle leader does not
    step); a follower replaying them holds the same block ids and makes the same steps."""
    channel = RecordingChannel()
    leader = LockstepEngine(build_engine_config(checkpoint, **ENGINE_ARGS), channel)  # type: ignore[arg-type]
    params = SamplingParams(max_tokens=6, temperature=1.0, seed=3, n=2, ignore_eos=True)
    leader.add_request("local", [9, 8, 7, 6, 5], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    leader_steps = [_step_tokens(leader.step())]
    kept = leader.handoff.reserve("kept", 10)
    dropped = leader.handoff.reserve("dropped", 7)
    assert channel.published[-1] == [Reserve("dropped", 7, tuple(dropped))]  # published without a step
    leader.handoff.release("dropped")
    leader.handoff.receive("kept", list(range(20, 30)), [41, 42], params)
    assert [type(op) for op in channel.published[-1]] == [Receive]
    while leader.has_unfinished():
        leader_steps.append(_step_tokens(leader.step()))
    free_after = leader.handoff.snapshot()
    leader.close()
    assert Reserve("kept", 10, tuple(kept)) in channel.published[1] and Release("dropped") in channel.published[3]

    follower = LLMEngine(build_engine_config(checkpoint, **ENGINE_ARGS))
    follower_steps = []
    step = follower.step
    follower.step = lambda: _record(follower_steps, step())  # type: ignore[method-assign]
    follow(follower, ReplayChannel(channel.published))  # type: ignore[arg-type]
    assert follower_steps == leader_steps
    assert ("kept", 1) in {key for outputs in leader_steps for key in outputs}
    assert follower.handoff.snapshot() == free_after
    assert free_after.num_free_blocks == free_after.num_usable_blocks


def test_a_follower_whose_reservation_differs_from_the_leaders_stops(checkpoint):
    follower = LLMEngine(build_engine_config(checkpoint, **ENGINE_ARGS))
    theirs = tuple(follower.handoff.num_blocks_for(8) * [3])  # not what a fresh pool hands out
    with pytest.raises(RuntimeError, match=r"rank 0 reserved \[3, 3\]: the ranks' KV pools diverged"):
        follow(follower, ReplayChannel([[Reserve("r", 8, theirs)]]))  # type: ignore[arg-type]


def test_rank_snapshots_report_every_ranks_kv_after_the_ops_before_them():
    leader_end, rank_end = multiprocessing.Pipe()
    leader, rank = LockstepChannel(0, [leader_end]), LockstepChannel(1, [rank_end])
    leader.publish([ReportKV()])
    assert rank.receive() == [ReportKV()]
    rank.answer(KVSnapshot(10, 12))
    assert leader.answers() == [KVSnapshot(10, 12)]
    leader.close()
    rank.close()


def test_the_channel_carries_ops_checks_agreement_and_ends_with_eof():
    leader_end, rank_end = multiprocessing.Pipe()
    leader, rank = LockstepChannel(0, [leader_end]), LockstepChannel(1, [rank_end])
    with ThreadPoolExecutor(1) as pool:
        agreed = pool.submit(rank.agree, "the number of KV blocks", 64)
        leader.agree("the number of KV blocks", 64)
        agreed.result(timeout=30)
        refused = pool.submit(rank.agree, "the number of KV blocks", 63)
        with pytest.raises(ValueError, match=r"disagree on the number of KV blocks: \[64, 63\]"):
            leader.agree("the number of KV blocks", 64)
        with pytest.raises(ValueError, match="--num-kv-blocks"):
            refused.result(timeout=30)
    ops = [Add("r", [1, 2], SamplingParams(max_tokens=3), 0, 12.5), AbortSample("r", 1), Step()]
    leader.publish(ops)
    assert rank.receive() == ops
    leader.close()
    with pytest.raises(EOFError):
        rank.receive()
    rank.close()
