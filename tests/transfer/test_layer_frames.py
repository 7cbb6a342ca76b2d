"""Layer ranges of chunk headers, coalescing of ready runs, and per-transfer layer ledgers."""

from __future__ import annotations

import pytest

from cleave.errors import InvalidArgument
from cleave.proto.cleave.v1 import common_pb2
from cleave.transfer.layer_frames import LayerLedger, coalesce, header_layers


def test_header_layers_reads_num_layers_zero_as_one():
    assert header_layers(common_pb2.KVChunkHeader(layer_index=3)) == range(3, 4)
    assert header_layers(common_pb2.KVChunkHeader(layer_index=3, num_layers=1)) == range(3, 4)
    assert header_layers(common_pb2.KVChunkHeader(layer_index=2, num_layers=5)) == range(2, 7)


def test_coalesce_merges_only_adjacent_runs_in_order():
    spans = [range(0, 2), range(2, 3), range(5, 6), range(6, 8), range(3, 4)]
    assert coalesce(spans) == [range(0, 3), range(5, 8), range(3, 4)]
    assert coalesce([]) == []
    assert coalesce([range(4, 5)]) == [range(4, 5)]


def test_ledger_counts_each_layer_once_and_says_when_complete():
    ledger = LayerLedger(4)
    assert not ledger.completes(range(0, 3))
    ledger.add(range(0, 3))
    assert (ledger.num_done, ledger.num_missing, ledger.is_complete) == (3, 1, False)
    assert ledger.completes(range(3, 4))
    with pytest.raises(InvalidArgument, match="layer 2 arrived twice"):
        ledger.add(range(2, 4))
    assert ledger.num_done == 3  # a refused run accounts nothing
    ledger.add(range(3, 4))
    assert ledger.is_complete


@pytest.mark.parametrize("layers, message", [
    (range(3, 5), "layer 4 outside"),
    (range(-1, 1), "layer -1 outside"),
    (range(2, 2), "not a run"),
    (range(0, 4, 2), "not a run"),
])
def test_ledger_refuses_bad_runs(layers, message):
    with pytest.raises(InvalidArgument, match=message):
        LayerLedger(4).check(layers)
