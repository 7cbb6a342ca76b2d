"""`graph_capture`: no automatic garbage collection while a stream captures (a collection can
destroy another engine's CUDA graphs mid-capture, which invalidates it), restored afterwards
on every path. `torch.cuda.graph` is replaced by a recorder: there is no capture on the CPU."""

from __future__ import annotations

import contextlib
import gc

import pytest
import torch

from cleave.graphs.runner import graph_capture


@pytest.fixture
def recorded(monkeypatch):
    seen: list[tuple[str, object, bool]] = []

    @contextlib.contextmanager
    def fake_graph(graph, pool=None):  # type: ignore[no-untyped-def]
        seen.append(("enter", pool, gc.isenabled()))
        yield
        seen.append(("exit", pool, gc.isenabled()))

    monkeypatch.setattr(torch.cuda, "graph", fake_graph)
    return seen


def test_collection_is_paused_inside_the_capture_and_back_after(recorded):
    assert gc.isenabled()
    with graph_capture("graph", pool=(1, 2)):
        assert not gc.isenabled()
    assert gc.isenabled()
    assert recorded == [("enter", (1, 2), False), ("exit", (1, 2), False)]


def test_a_failing_capture_restores_collection(recorded):
    with pytest.raises(RuntimeError, match="capture failed"):
        with graph_capture("graph"):
            raise RuntimeError("capture failed")
    assert gc.isenabled()


def test_collection_left_off_by_the_caller_stays_off(recorded):
    gc.disable()
    try:
        with graph_capture("graph"):
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()
