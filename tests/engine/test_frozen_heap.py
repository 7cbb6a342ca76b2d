"""`frozen_heap`: objects alive at entry are skipped by collections inside the block and
collectable again after it; nested blocks share one freeze; an existing freeze is left alone."""

from __future__ import annotations

import gc
import weakref
from pathlib import Path

import pytest

from cleave.engine.frozen_heap import frozen_heap
from cleave.engine.llm import LLM
from cleave.generation.sampling_params import SamplingParams
from cleave.testing.tiny_models import write_tiny_checkpoint


class Node:
    """A reference cycle's member, observable through a weak reference."""

    def __init__(self) -> None:
        self.other: Node | None = None


def make_cycle() -> weakref.ref:
    first, second = Node(), Node()
    first.other, second.other = second, first
    return weakref.ref(first)


@pytest.fixture(autouse=True)
def nothing_frozen():
    if gc.get_freeze_count():
        pytest.skip("something in this process froze objects already")
    yield
    assert gc.get_freeze_count() == 0
    gc.unfreeze()


def test_garbage_from_before_the_block_waits_for_its_exit() -> None:
    old = make_cycle()  # unreachable, not yet collected
    with frozen_heap():
        assert gc.get_freeze_count() > 0
        new = make_cycle()
        gc.collect()
        assert new() is None  # made inside: collected as usual
        assert old() is not None  # frozen: skipped
    assert gc.get_freeze_count() == 0
    gc.collect()
    assert old() is None


def test_nested_blocks_share_one_freeze_released_by_the_last() -> None:
    # Only a freeze raises the count; a frozen object freed meanwhile (another thread dropping
    # its last reference) lowers it, so the inner block is checked for not freezing again.
    with frozen_heap():
        frozen = gc.get_freeze_count()
        with frozen_heap():
            assert 0 < gc.get_freeze_count() <= frozen
        assert 0 < gc.get_freeze_count() <= frozen
    assert gc.get_freeze_count() == 0


def test_an_error_inside_the_block_still_unfreezes() -> None:
    with pytest.raises(ValueError), frozen_heap():
        raise ValueError("boom")
    assert gc.get_freeze_count() == 0


def test_a_freeze_made_elsewhere_is_left_alone() -> None:
    sentinel = [Node()]  # a tracked container, frozen below with everything else
    gc.freeze()  # e.g. a worker's start-up objects
    try:
        frozen = gc.get_freeze_count()
        with frozen_heap():
            assert 0 < gc.get_freeze_count() <= frozen  # not frozen again (frees only lower it)
        # not undone: the sentinel is still in the permanent generation, which get_objects skips
        assert not any(obj is sentinel for obj in gc.get_objects())
    finally:
        gc.unfreeze()
    assert any(obj is sentinel for obj in gc.get_objects())


def test_llm_generate_steps_inside_a_frozen_heap(tmp_path: Path) -> None:
    llm = LLM(write_tiny_checkpoint(tmp_path / "tiny", "llama"), device="cpu", dtype="float32", max_model_len=64)
    frozen_counts: list[int] = []
    step = llm.engine.step

    def counting_step():  # type: ignore[no-untyped-def]
        frozen_counts.append(gc.get_freeze_count())
        return step()

    llm.engine.step = counting_step  # type: ignore[method-assign]
    (output,) = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    assert len(output.outputs[0].token_ids) == 3
    assert frozen_counts and min(frozen_counts) > 0
    assert gc.get_freeze_count() == 0
